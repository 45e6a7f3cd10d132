"""A register claiming absurd sizes (a megabyte model name, 2^62 GPU blocks)
is refused with bad_value before anything changes, against a real sidecar."""

from __future__ import annotations

import os

import pytest
import sidecar_proc as sp
from sidecar_proc import Sidecar, connect, make_kv

from contract import protocol as p
from engine_shim import SidecarError
from engine_shim.channel import Channel


@pytest.fixture(scope="module")
def sidecar():
    s = Sidecar().start()
    yield s
    try:
        assert s.stop() == 0
    finally:
        s.cleanup()


def layout(**changes: object) -> p.KVLayoutMsg:
    fields: dict[str, object] = {
        "model_name": "tiny",
        "model_revision": "r1",
        "layout": "paged",
        "dtype": "float32",
        "tp_size": 1,
        "tp_rank": 0,
        "num_layers": sp.NUM_LAYERS,
        "num_kv_heads": 2,
        "head_dim": 8,
        "tokens_per_block": sp.TOKENS_PER_BLOCK,
        "layer_block_bytes": 2 * sp.TOKENS_PER_BLOCK * 2 * 8 * 4,
        "num_gpu_blocks": sp.NUM_GPU_BLOCKS,
    }
    return p.KVLayoutMsg(**{**fields, **changes})  # type: ignore[arg-type]


def register(kv: p.KVLayoutMsg | None = None, **changes: object) -> p.Register:
    fields: dict[str, object] = {
        "v": p.PROTOCOL_VERSION,
        "id": 0,
        "session": "s" + os.urandom(4).hex(),
        "engine_id": "limits",
        "kv": kv or layout(),
    }
    return p.Register(**{**fields, **changes})  # type: ignore[arg-type]


BIG = "x" * (1 << 20)
TOO_LONG = "y" * 257
REFUSED = {
    "model_name 1 MB": register(layout(model_name=BIG)),
    "model_revision": register(layout(model_revision=TOO_LONG)),
    "tenant": register(layout(tenant=TOO_LONG)),
    "layout": register(layout(layout=TOO_LONG)),
    "dtype": register(layout(dtype=TOO_LONG)),
    "engine_id": register(engine_id=TOO_LONG),
    "session": register(session=TOO_LONG),
    "pid_ns": register(pid_ns=TOO_LONG),
    "model_name in bytes": register(layout(model_name="é" * 129)),  # 258 bytes
    "num_gpu_blocks 2^62": register(layout(num_gpu_blocks=2**62)),
    "num_gpu_blocks 2^31+1": register(layout(num_gpu_blocks=2**31 + 1)),
    "num_layers": register(layout(num_layers=2**20)),
    "num_kv_heads": register(layout(num_kv_heads=2**40)),
    "head_dim": register(layout(head_dim=2**40)),
    "tokens_per_block": register(layout(tokens_per_block=2**40)),
    "tp_size": register(layout(tp_size=2**40)),
    "layer_block_bytes": register(layout(layer_block_bytes=2**50)),
    "pid": register(pid=2**40),
}


def field_of(case: str) -> str:
    return case.split(" ")[0]


@pytest.mark.parametrize("case", list(REFUSED))
def test_an_oversized_register_is_refused_and_changes_nothing(sidecar, case):
    channel = Channel(sidecar.endpoint, 2.0)
    try:
        with pytest.raises(SidecarError) as info:
            channel.call(REFUSED[case])
        assert info.value.code == "bad_value"
        assert field_of(case) in info.value.message
        assert len(info.value.message) < 300  # says what is allowed, not the value
        figures, _ = channel.call(p.Stats(v=p.PROTOCOL_VERSION, id=0))
        assert figures.stats["engines"] == []
        assert "capacity_blocks" not in figures.stats["tiers"]["cpu"]  # no cache built
    finally:
        channel.close()


def test_the_largest_allowed_values_register():
    most = "z" * 256
    sidecar = Sidecar().start()
    channel = Channel(sidecar.endpoint, 2.0)
    try:
        reply, _ = channel.call(
            register(
                layout(model_name=most, tenant=most, num_gpu_blocks=2**31),
                engine_id="e" * 128,
                session="s" * 64,
            )
        )
        assert reply.num_slots > 0
        with connect(sidecar.endpoint, make_kv(None), engine_id="plain"):
            pass
        assert sidecar.stop() == 0
    finally:
        channel.close()
        sidecar.cleanup()


def test_geometries_and_namespaces_past_their_limits_are_refused_and_change_nothing():
    """What a geometry or a namespace holds stays for the sidecar's life (a
    geometry: its tiers, hot index, I/O threads, files): any client could
    register new ones until the sidecar ran out of file descriptors."""
    s = Sidecar("--set", "max_geometries=2", "--set", "max_namespaces=2").start()
    channel = Channel(s.endpoint, 5.0)
    try:
        for layers in (1, 2):
            channel.call(
                register(layout(num_layers=layers, layer_block_bytes=4096), engine_id=f"g{layers}")
            )
        segments = [n for n in os.listdir("/dev/shm") if n.startswith(s.shm_prefix)]
        with pytest.raises(SidecarError, match="max_geometries") as info:
            channel.call(register(layout(num_layers=3, layer_block_bytes=4096), engine_id="g3"))
        assert info.value.code == "bad_value"
        assert [n for n in os.listdir("/dev/shm") if n.startswith(s.shm_prefix)] == segments
        channel.call(register(layout(num_layers=1, layer_block_bytes=4096), engine_id="h1"))
        channel.call(
            register(layout(num_layers=1, layer_block_bytes=4096, tenant="b"), engine_id="b1")
        )
        with pytest.raises(SidecarError, match="max_namespaces"):
            channel.call(
                register(layout(num_layers=1, layer_block_bytes=4096, tenant="c"), engine_id="c1")
            )
        channel.call(
            register(layout(num_layers=2, layer_block_bytes=4096, tenant="b"), engine_id="b2")
        )
        assert s.stop() == 0
    finally:
        channel.close()
        s.cleanup()
