"""One sidecar, two models of different geometries (issue 28), real processes.

Model A is the tests' tiny model (fp32, 2 layers, 2 heads of 8: 4 KiB
blocks); model B is bf16 with 3 layers and 4 heads of 16 (12 KiB blocks).
They register on one sidecar whose 4 MiB CPU tier is 4 extents of 1 MiB.
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import sidecar_proc as sp
import torch
from sidecar_proc import Sidecar, connect, stats_of, tokens

from engine_shim import SidecarError

B_MODEL = {
    "model_name": "other",
    "model_revision": "r7",
    "tokens_per_block": sp.TOKENS_PER_BLOCK,
    "num_kv_heads": 4,
    "head_dim": 16,
}
B_SHAPE = (2, sp.TOKENS_PER_BLOCK, 4, 16)
B_LAYERS = 3


def b_kv(seed: int | None) -> list[torch.Tensor]:
    shape = (sp.NUM_GPU_BLOCKS, *B_SHAPE)
    if seed is None:
        return [torch.zeros(shape, dtype=torch.bfloat16) for _ in range(B_LAYERS)]
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g).to(torch.bfloat16) for _ in range(B_LAYERS)]


def fill(kv: list[torch.Tensor], seed: int) -> None:
    """New random contents for every layer, in place (registered tensors)."""
    g = torch.Generator().manual_seed(seed)
    for layer in kv:
        layer.copy_(torch.randn(layer.shape, generator=g).to(layer.dtype))


def prompt(i: int, n: int) -> np.ndarray:
    return tokens(n, start=1000 * i)


def same(a: list[torch.Tensor], b: list[torch.Tensor], blocks: np.ndarray) -> bool:
    idx = torch.as_tensor(blocks)
    return all(
        torch.equal(x[idx].view(torch.uint8), y[idx].view(torch.uint8))
        for x, y in zip(a, b, strict=True)
    )


def extents(sidecar: Sidecar) -> list[int]:
    return [g["extents"] for g in stats_of(sidecar)["geometries"]]


def test_two_geometries_interleave_byte_exact_on_one_sidecar() -> None:
    s = Sidecar("--set", "cpu_extent_size=1MiB").start()
    try:
        a_kv, b_kvs = sp.make_kv(1), b_kv(2)
        with connect(s.endpoint, a_kv) as a, connect(s.endpoint, b_kvs, **B_MODEL) as b:
            blocks = np.arange(8)
            for i in range(4):  # interleaved saves
                assert a.save(prompt(i, 8), blocks).wait() == 8 * sp.TOKENS_PER_BLOCK
                assert b.save(prompt(i, 8), blocks).wait() == 8 * sp.TOKENS_PER_BLOCK
            # Same tokens, other model: never the other's blocks.
            assert a.lookup(prompt(9, 8)) == 0
            fresh_a, fresh_b = sp.make_kv(None), b_kv(None)
            with (
                connect(s.endpoint, fresh_a) as la,
                connect(s.endpoint, fresh_b, **B_MODEL) as lb,
            ):
                order = np.arange(8)[::-1].copy()
                assert la.load(prompt(3, 8), order).wait() == 8 * sp.TOKENS_PER_BLOCK
                assert lb.load(prompt(3, 8), order).wait() == 8 * sp.TOKENS_PER_BLOCK
                assert all(torch.equal(x[order], y[:8]) for x, y in zip(fresh_a, a_kv, strict=True))
                assert all(
                    torch.equal(x[order], y[:8]) for x, y in zip(fresh_b, b_kvs, strict=True)
                )
            stats = stats_of(s)
            geometries = stats["geometries"]
            assert [g["tiers"]["cpu"]["cached_blocks"] for g in geometries] == [32, 32]
            assert {g["tiers"]["cpu"]["block_bytes"] for g in geometries} == {4096, 12288}
            assert stats["tiers"]["cpu"]["cached_blocks"] == 64
            assert stats["tiers"]["cpu"]["cached_bytes"] == 32 * 4096 + 32 * 12288
    finally:
        s.stop()


def test_capacity_moves_between_models_under_pressure_and_blocks_keep_their_bytes() -> None:
    """A fills the CPU tier; B then takes extents from it (A's coldest blocks
    evicted, the rest of the extent moved); then A takes capacity back. Every
    block still cached loads the bytes it was saved with."""
    s = Sidecar("--set", "cpu_extent_size=1MiB", "--set", "evict_ratio=0").start()
    n = sp.NUM_GPU_BLOCKS
    blocks = np.arange(n)
    try:
        a_kv, b_kvs = sp.make_kv(None), b_kv(None)
        with connect(s.endpoint, a_kv) as a, connect(s.endpoint, b_kvs, **B_MODEL) as b:
            a_saved = []
            for i in range(16):  # 1,024 blocks of A: all 4 extents of 256
                fill(a_kv, 100 + i)
                assert a.save(prompt(i, n), blocks).wait() == n * sp.TOKENS_PER_BLOCK
                a_saved.append(i)
            assert extents(s) == [4, 0]
            for i in range(3):  # 192 blocks of B: 3 extents of 85 at 12 KiB
                fill(b_kvs, 200 + i)
                assert b.save(prompt(i, n), blocks).wait() == n * sp.TOKENS_PER_BLOCK
            stats = stats_of(s)
            assert extents(s) == [1, 3]
            assert stats["tiers"]["cpu"]["extent_moves"] == 3
            for i in range(3, 5):  # and back: A's blocks are now the younger
                fill(a_kv, 100 + i)  # (a prompt saved before, evicted since)
                a.save(prompt(i, n), blocks).wait()
            fresh_a, fresh_b = sp.make_kv(None), b_kv(None)
            with (
                connect(s.endpoint, fresh_a) as la,
                connect(s.endpoint, fresh_b, **B_MODEL) as lb,
            ):
                hits = 0
                for i in a_saved:
                    got = la.load(prompt(i, n), blocks).wait() // sp.TOKENS_PER_BLOCK
                    if got:
                        hits += 1
                        fill(a_kv, 100 + i)
                        assert same(fresh_a, a_kv, np.arange(got)), f"A prompt {i}"
                assert hits >= 2
                for i in range(3):
                    got = lb.load(prompt(i, n), blocks).wait() // sp.TOKENS_PER_BLOCK
                    if got:
                        fill(b_kvs, 200 + i)
                        assert same(fresh_b, b_kvs, np.arange(got)), f"B prompt {i}"
            cpu = stats_of(s)["tiers"]["cpu"]
            assert cpu["extents"] == 4 and cpu["free_extents"] == 0
    finally:
        s.stop()


def test_every_geometry_has_the_remote_tier(redis_bin) -> None:
    """Both models write through to one Redis; a second "host" loads the
    second model's blocks from it, byte-exact."""
    from redis_servers import RedisServer

    redis = RedisServer().start()
    settings = (
        "--set",
        f"remote_url={redis.url}",
        "--set",
        "write_policy=write_through",
        "--set",
        "cpu_extent_size=1MiB",
    )
    first, second = Sidecar(*settings).start(), None
    try:
        a_kv, b_kvs = sp.make_kv(1), b_kv(2)
        with connect(first.endpoint, a_kv) as a, connect(first.endpoint, b_kvs, **B_MODEL) as b:
            a.save(prompt(0, 6), np.arange(6)).wait()
            b.save(prompt(0, 6), np.arange(6)).wait()

            def written() -> bool:
                remote = [
                    g["tiers"]["remote"]["cached_blocks"] for g in stats_of(first)["geometries"]
                ]
                return remote == [6, 6] and stats_of(first)["plans_in_flight"] == 0

            sp.wait_for(written)
        assert redis.client().dbsize() == 12
        second = Sidecar(*settings).start()
        fresh = b_kv(None)
        with connect(second.endpoint, fresh, **B_MODEL) as other_host:
            assert other_host.load(prompt(0, 6), np.arange(6)).wait() == 6 * sp.TOKENS_PER_BLOCK
            assert same(fresh, b_kvs, np.arange(6))
    finally:
        first.stop()
        if second is not None:
            second.stop()
        redis.cleanup()


def test_every_geometry_has_the_ssd_tier_and_they_share_its_budget(tmp_path) -> None:
    """Both models write through to SSD, whose 4 extents of 1 MiB they
    share: B takes extents from A under pressure (A's blocks in them
    dropped), and after a restart, which reopens both models' files before
    any engine registers, every block still on SSD loads the bytes it was
    saved with (the CPU tier starts empty: these loads come from SSD)."""
    settings = (
        "--set", f"ssd_dirs={tmp_path / 'ssd'}",
        "--set", "ssd_capacity_per_dir=4MiB",
        "--set", "ssd_extent_size=1MiB",
        "--set", "cpu_extent_size=1MiB",
    )  # fmt: skip
    runtime = sp.tmp_dir()
    first = Sidecar(*settings, runtime_dir=runtime).start()
    again: Sidecar | None = None
    n, blocks = sp.NUM_GPU_BLOCKS, np.arange(sp.NUM_GPU_BLOCKS)

    def ssd_of(s: Sidecar) -> list[dict]:
        return [g["tiers"]["ssd"] for g in stats_of(s)["geometries"]]

    def settled(s: Sidecar, a_blocks: int, b_blocks: int) -> bool:
        tiers = ssd_of(s)
        return stats_of(s)["plans_in_flight"] == 0 and (
            [t["cached_blocks"] for t in tiers][: 1 + (b_blocks > 0)]
            == [a_blocks, b_blocks][: 1 + (b_blocks > 0)]
        )

    try:
        a_kv, b_kvs = sp.make_kv(None), b_kv(None)
        with connect(first.endpoint, a_kv) as a, connect(first.endpoint, b_kvs, **B_MODEL) as b:
            for i in range(16):  # 1,024 blocks of A: every SSD extent (256 slots each)
                fill(a_kv, 100 + i)
                assert a.save(prompt(i, n), blocks).wait() == n * sp.TOKENS_PER_BLOCK
            sp.wait_for(lambda: settled(first, 1024, 0))
            for i in range(2):  # 128 blocks of B: two extents of 85 at 12 KiB
                fill(b_kvs, 200 + i)
                assert b.save(prompt(i, n), blocks).wait() == n * sp.TOKENS_PER_BLOCK
            sp.wait_for(lambda: stats_of(first)["plans_in_flight"] == 0)
            tiers = ssd_of(first)
            assert [t["extents"] for t in tiers] == [2, 2]
            assert tiers[1]["cached_blocks"] == 128 and tiers[0]["cached_blocks"] == 512
            ssd = stats_of(first)["tiers"]["ssd"]
            assert ssd["extent_moves"] == 2 and ssd["dropped_blocks"] == 512
            assert ssd["cached_bytes"] == 512 * 4096 + 128 * 12288
        assert first.stop() == 0
        again = Sidecar(*settings, runtime_dir=runtime, instance=first.instance).start()
        fresh_a, fresh_b = sp.make_kv(None), b_kv(None)
        with (
            connect(again.endpoint, fresh_a) as la,
            connect(again.endpoint, fresh_b, **B_MODEL) as lb,
        ):
            assert [t["cached_blocks"] for t in ssd_of(again)] == [512, 128]
            loaded_a = 0
            for i in range(16):
                got = la.load(prompt(i, n), blocks).wait() // sp.TOKENS_PER_BLOCK
                if got:
                    fill(a_kv, 100 + i)
                    assert same(fresh_a, a_kv, np.arange(got)), f"A prompt {i}"
                loaded_a += got
            assert loaded_a == 512
            for i in range(2):
                assert lb.load(prompt(i, n), blocks).wait() == n * sp.TOKENS_PER_BLOCK
                fill(b_kvs, 200 + i)
                assert same(fresh_b, b_kvs, blocks), f"B prompt {i}"
    finally:
        for s in (first, again):
            if s is not None:
                s.cleanup()
        shutil.rmtree(runtime, ignore_errors=True)


def test_a_geometry_the_cpu_tier_refuses_opens_no_ssd_store(tmp_path) -> None:
    """Its blocks (2 MiB here) do not fit a CPU extent (1 MiB): the register
    is refused with layout_mismatch and changes nothing, SSD files included."""
    ssd = tmp_path / "ssd"
    s = Sidecar(
        "--set", f"ssd_dirs={ssd}",
        "--set", "ssd_capacity_per_dir=64MiB",
        "--set", "cpu_extent_size=1MiB",
    ).start()  # fmt: skip
    try:
        big = [torch.zeros((4, 2, 1024, 8, 64)) for _ in range(2)]  # 2 x 1 MiB a block
        with pytest.raises(SidecarError) as refused:
            connect(s.endpoint, big, tokens_per_block=1024, num_kv_heads=8, head_dim=64)
        assert refused.value.code == "layout_mismatch"
        assert not list(ssd.glob("*"))
        assert s.stop() == 0
    finally:
        s.cleanup()
