"""The parts of the SGLang backend that need no SGLang, in the main suite:
its extra config, the host pool's layouts as planes (plain tensors of
SGLang 0.5.23's shapes), the keys of a call, and the sidecar's Save with a
skipped prefix that those keys rely on, against a real sidecar."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
from sidecar_proc import Sidecar

from engine_shim import KVClient, SidecarUnavailable
from engine_shim.sglang.geometry import HostGeometry, RankShard
from engine_shim.sglang.keys import PageChain, PrefixMissing, digests
from engine_shim.sglang.settings import ConfigError, StorageSettings

DYNAMIC = {
    "backend_name": "kvsidecar",
    "module_path": "engine_shim.sglang_storage",
    "class_name": "KVSidecarStorage",
    "interface_v1": 1,
    "hicache_storage_pass_prefix_keys": True,
}


# ---- the extra config --------------------------------------------------------------


def test_settings_take_sglangs_keys_and_its_model_name() -> None:
    s = StorageSettings.from_extra_config(
        {**DYNAMIC, "model_revision": "abc", "tenant": "t1"}, model_name="meta/llama"
    )
    assert (s.model_name, s.model_revision, s.tenant, s.endpoint) == (
        "meta/llama",
        "abc",
        "t1",
        None,
    )
    named = StorageSettings.from_extra_config(
        {**DYNAMIC, "model_revision": "abc", "model_name": "mine", "timeout": 2}, model_name="x"
    )
    assert (named.model_name, named.timeout) == ("mine", 2)


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"model_revision": None}, "model_revision"),
        ({"model_revision": ""}, "model_revision"),
        ({"interface_v1": None}, "interface_v1"),
        ({"interface_v1": False}, "interface_v1"),
        ({"timeout": 0}, "timeout"),
        ({"timeout": True}, "timeout"),
        ({"timeout": float("nan")}, "timeout"),
        ({"timeout": float("inf")}, "timeout"),
        ({"endpoint": "localhost:5555"}, "endpoint"),
        ({"tenant": 3}, "tenant"),
        ({"admin_token_file": ""}, "admin_token_file"),
        ({"modelrevision": "x"}, "modelrevision"),
    ],
)
def test_a_bad_extra_config_names_the_key(change: dict, named: str) -> None:
    extra = {**DYNAMIC, "model_revision": "abc", **change}
    extra = {k: v for k, v in extra.items() if v is not None}
    with pytest.raises(ConfigError, match=named):
        StorageSettings.from_extra_config(extra, model_name="m")


def test_no_extra_config_or_no_model_name_is_an_error() -> None:
    with pytest.raises(ConfigError, match="extra-config"):
        StorageSettings.from_extra_config(None, model_name="m")
    with pytest.raises(ConfigError, match="model_name"):
        StorageSettings.from_extra_config({**DYNAMIC, "model_revision": "r"}, model_name=None)


# ---- the host pool's pages as planes ---------------------------------------------------

P, S, L, H, D, R = 5, 4, 3, 2, 8, 24


def _flat_page(kv: torch.Tensor, layout: str, page: int) -> torch.Tensor:
    """SGLang's `get_data_page(page * S, flat=True)` for an MHA pool."""
    if layout == "layer_first":
        return kv[:, :, page * S : (page + 1) * S].flatten()
    if layout == "page_first":
        return kv[:, page * S : (page + 1) * S].flatten()
    return kv[:, page : page + 1].flatten()  # page_first_direct, page_head


MHA_SHAPES = {
    "layer_first": (2, L, P * S, H, D),
    "page_first": (2, P * S, L, H, D),
    "page_first_direct": (2, P, L, S, H, D),
    "page_head": (2, P, H, S, L, D),
}
MLA_SHAPES = {
    "layer_first": (L, P * S, 1, R),
    "page_first": (P * S, L, 1, R),
    "page_first_direct": (P, L, S, 1, R),
}


@pytest.mark.parametrize("layout", sorted(MHA_SHAPES))
def test_mha_planes_are_views_holding_each_page_whole(layout: str) -> None:
    kv = torch.randn(MHA_SHAPES[layout]).to(torch.bfloat16)
    g = HostGeometry.of(kv, layout, S, is_mla=False)
    assert (g.num_pages, g.page_size, g.num_heads, g.head_dim) == (P, S, H, D)
    assert len(g.planes) == (2 * L if layout == "layer_first" else 2)
    assert g.page_bytes == 2 * L * S * H * D * 2
    storage = kv.untyped_storage().data_ptr()
    assert all(p.untyped_storage().data_ptr() == storage for p in g.planes)  # never a copy
    for page in range(P):  # a slot holds SGLang's own flat page, in its order
        slot = torch.cat([p[page].reshape(-1) for p in g.planes])
        assert torch.equal(slot, _flat_page(kv, layout, page))


@pytest.mark.parametrize("layout", sorted(MLA_SHAPES))
def test_mla_planes_are_views_holding_each_page_whole(layout: str) -> None:
    kv = torch.randn(MLA_SHAPES[layout])
    g = HostGeometry.of(kv, layout, S, is_mla=True)
    assert (g.num_pages, g.num_heads, g.head_dim) == (P, 1, R)
    assert len(g.planes) == (L if layout == "layer_first" else 1)
    assert g.page_bytes == L * S * R * 4
    for page in range(P):  # SGLang's flat page, in its order
        slot = torch.cat([p[page].reshape(-1) for p in g.planes])
        if layout == "layer_first":
            whole = kv[:, page * S : (page + 1) * S]
        elif layout == "page_first":
            whole = kv[page * S : (page + 1) * S]
        else:
            whole = kv[page]
        assert torch.equal(slot, whole.flatten())


@pytest.mark.parametrize(
    ("kv", "layout", "is_mla", "said"),
    [
        (torch.zeros(2, L, P * S, H, D), "page_unified", False, "page_unified"),
        (torch.zeros(2, L, P * S, H, D), "page_head", True, "not supported"),
        (torch.zeros(2, L, P * S + 1, H, D), "layer_first", False, "whole pages"),
        (torch.zeros(2, L, P * S, H, D).transpose(3, 4), "layer_first", False, "contiguous"),
        (torch.zeros(3, L, P * S, H, D), "layer_first", False, "K and V"),
        (torch.zeros(2, P, L, S + 1, H, D), "page_first_direct", False, "pages of"),
        (torch.zeros(L, P * S, 2, R), "layer_first", True, "latent"),
        ([torch.zeros(4)], "layer_first", False, "one tensor"),
    ],
)
def test_a_pool_it_cannot_serve_is_refused_saying_why(
    kv: object, layout: str, is_mla: bool, said: str
) -> None:
    with pytest.raises(ValueError, match=said):
        HostGeometry.of(kv, layout, S, is_mla=is_mla)


def test_the_namespace_detail_names_the_engine_the_layout_and_the_mha_rank() -> None:
    assert RankShard(False, 1, 4).detail("page_first") == "sglang:mha:page_first:tp1of4"
    assert RankShard(True, 3, 4).detail("layer_first") == "sglang:mla:layer_first"
    assert (
        RankShard(False, 0, 1, 1, 2).detail("layer_first") == "sglang:mha:layer_first:tp0of1:pp1of2"
    )
    with pytest.raises(ValueError, match="tp_rank"):
        RankShard(False, 2, 2)


# ---- the keys of a call -------------------------------------------------------------------

HASHES = [f"{i:064x}" for i in range(1, 9)]


def _hasher_client(detail: str) -> KVClient:
    """A client whose namespace is set (no sidecar needed to compute keys)."""
    client = KVClient.connect("ipc:///nonexistent/kvsidecar-test.sock", timeout=0.05)
    planes = [torch.zeros(1, S * H * D) for _ in range(2)]
    with contextlib.suppress(SidecarUnavailable):  # no sidecar: kept for later
        client.register(
            planes, model_name="m", model_revision="r", tokens_per_block=S,
            num_kv_heads=H, head_dim=D, layout="block_major", layout_detail=detail,
        )  # fmt: skip
    return client


def test_a_calls_keys_do_not_depend_on_where_sglang_split_the_sequence() -> None:
    client = _hasher_client("sglang:mha:layer_first:tp0of1")
    try:
        whole = PageChain.of(HASHES, [], client.digest_keys)
        split = PageChain.of(HASHES[5:], HASHES[:5], client.digest_keys)
        assert whole.keys.tobytes() == split.keys.tobytes()
        assert (whole.skip, split.skip, split.num_pages) == (0, 5, 3)
        assert split.hits(8 * S, S) == 3 and split.hits(6 * S, S) == 1 and split.hits(S, S) == 0
        assert split.block_ids(np.array([7, 9, 11])).tolist() == [0, 0, 0, 0, 0, 7, 9, 11]
        with pytest.raises(PrefixMissing, match="hicache_storage_pass_prefix_keys"):
            PageChain.of(HASHES, None, client.digest_keys)
    finally:
        client.close()


def test_sglang_and_vllm_engines_of_one_model_never_share_a_key() -> None:
    sglang = _hasher_client("sglang:mha:layer_first:tp0of1")
    vllm = _hasher_client("vllm:LBNHC")
    rank1 = _hasher_client("sglang:mha:layer_first:tp1of2")
    try:
        raw = digests(HASHES)
        keys = [c.digest_keys(raw).tobytes() for c in (sglang, vllm, rank1)]
        assert len(set(keys)) == 3
        assert sglang.block_keys(np.arange(len(HASHES) * S)).tobytes() != keys[0]
    finally:
        for client in (sglang, vllm, rank1):
            client.close()


def test_digests_read_sha256_hex_and_hash_any_other_string() -> None:
    assert digests(HASHES[:2]) == [bytes.fromhex(h) for h in HASHES[:2]]
    other = digests(["key0", HASHES[0]])
    assert len(other[0]) == 32 and other[1] == bytes.fromhex(HASHES[0])
    assert digests(["g" * 64])[0] != digests(["h" * 64])[0]


# ---- a Save past a prefix the engine holds no bytes for, on a real sidecar ----------------


def test_a_save_past_a_skipped_prefix_stores_only_when_the_prefix_is_there(
    sidecar: Sidecar, open_client: object
) -> None:
    kv = [torch.arange(8 * 64, dtype=torch.float32).reshape(8, 64) + 1000 * i for i in range(2)]
    client = open_client(sidecar.endpoint, kv, layout="block_major")  # type: ignore[operator]
    keys = client.digest_keys(digests(HASHES[:6]))
    placeholders = np.array([0, 0, 0, 5, 6, 7])  # block 0 must never be read
    with pytest.raises(ValueError, match="skip_tokens"):
        client.save_keys(keys, placeholders, skip_tokens=3)
    # Blocks 0..2 of the chain are not in the sidecar: nothing is stored.
    assert client.save_keys(keys, placeholders, skip_tokens=3 * 16).wait() == 0
    assert client.lookup_keys(keys) == 0
    assert client.save_keys(keys[:3], np.array([1, 2, 3])).wait() == 3 * 16
    assert client.save_keys(keys, placeholders, skip_tokens=3 * 16).wait() == 6 * 16
    assert client.lookup_keys(keys) == 6 * 16
    for t in kv:
        t.zero_()
    assert client.load_keys(keys, np.array([0, 0, 0, 1, 2, 3]), skip_tokens=3 * 16).wait() == 96
    for i, t in enumerate(kv):  # pages 3..5 came from blocks 5..7, block 0 stayed out
        expected = torch.arange(5 * 64, 8 * 64, dtype=torch.float32).reshape(3, 64) + 1000 * i
        assert torch.equal(t[1:4], expected) and not t[0].any()
