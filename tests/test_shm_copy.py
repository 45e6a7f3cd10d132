"""save_blocks / load_blocks: byte-exact round trips through real shm, the C
path against the torch loop, and bad input that raises and copies nothing."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from shm_helpers import checked_prefix, shm_entries, unique_prefix

from shm import copy as shm_copy
from shm.layout import BlockLayout
from shm.pool import ShmPool, ShmPoolError

torch = pytest.importorskip("torch")

NEEDS_C = pytest.mark.skipif("c" not in shm_copy.IMPLS, reason="shm._blockcopy is not built")
SENTINEL = 0xAB


@pytest.fixture
def pool():
    with checked_prefix("copy") as prefix, ShmPool.create(prefix, 4 << 20) as created:
        created.segment_view(0)[:] = SENTINEL
        yield created


def random_layers(num_layers: int, shape: tuple[int, ...], dtype, seed: int) -> list:
    gen = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return [torch.randn(shape, generator=gen).to(dtype) for _ in range(num_layers)]
    return [torch.randint(-100, 100, shape, generator=gen).to(dtype) for _ in range(num_layers)]


def raw(t) -> np.ndarray:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().copy()


@pytest.mark.parametrize("impl", shm_copy.IMPLS)
@pytest.mark.parametrize(
    "dtype,shape",
    [
        (torch.float16, (12, 2, 16, 2, 8)),
        (torch.bfloat16, (9, 16, 4)),
        (torch.float32, (7, 3, 5)),  # 60-byte blocks: nothing aligned
        (torch.int8, (10, 1)),
        (torch.float64, (6,)),
    ],
)
def test_round_trip_is_byte_exact_and_follows_the_layout(pool, impl, dtype, shape):
    src = random_layers(3, shape, dtype, seed=1)
    layout = BlockLayout.for_tensors(src)
    rng = np.random.default_rng(0)
    blocks = rng.permutation(shape[0])[:5]
    slots = rng.permutation(pool.num_slots(layout.slot_stride))[:5]
    shm_copy.save_blocks(src, blocks, pool, slots, layout, 0, impl=impl)
    for block, slot in zip(blocks, slots, strict=True):
        view = pool.slot_view(int(slot), layout.slot_stride)
        for layer, tensor in enumerate(src):
            start = layout.offset(0, layer)
            got = view[start : start + layout.layer_block_bytes]
            assert np.array_equal(got, raw(tensor[int(block)]))
        assert (view[layout.block_bytes :] == SENTINEL).all()  # padding untouched
    dst = [torch.zeros_like(t) for t in src]
    targets = rng.permutation(shape[0])[:5]
    shm_copy.load_blocks(dst, targets, pool, slots, layout, 0, impl=impl)
    for layer in range(3):
        got, want = dst[layer][torch.as_tensor(targets)], src[layer][torch.as_tensor(blocks)]
        assert np.array_equal(raw(got), raw(want))
        others = np.setdiff1d(np.arange(shape[0]), targets)
        assert not raw(dst[layer][torch.as_tensor(others)]).any()


@pytest.mark.parametrize("impl", shm_copy.IMPLS)
def test_tp_ranks_write_disjoint_shards_of_the_same_slots(pool, impl):
    tp, shape = 3, (8, 4, 6)
    ranks = [random_layers(2, shape, torch.float16, seed=10 + r) for r in range(tp)]
    layout = BlockLayout.for_tensors(ranks[0], tp_size=tp)
    blocks, slots = np.array([5, 0, 3]), np.array([2, 7, 4])
    for rank, layers in enumerate(ranks):
        shm_copy.save_blocks(layers, blocks, pool, slots, layout, rank, impl=impl)
    for block, slot in zip(blocks, slots, strict=True):
        view = pool.slot_view(int(slot), layout.slot_stride)
        expect = np.concatenate([raw(t[int(block)]) for layers in ranks for t in layers])
        assert np.array_equal(view[: layout.block_bytes], expect)
    for rank, layers in enumerate(ranks):
        back = [torch.zeros_like(t) for t in layers]
        shm_copy.load_blocks(back, blocks, pool, slots, layout, rank, impl=impl)
        for got, want in zip(back, layers, strict=True):
            index = torch.as_tensor(blocks)
            assert torch.equal(got[index], want[index])


@NEEDS_C
@pytest.mark.parametrize("large", [True, False])
@pytest.mark.parametrize("layer_bytes", [3007, 65536])
def test_c_and_torch_give_identical_bytes(layer_bytes, large):
    """Large (> THREAD_MIN_BYTES): the C path streams both ways on two
    threads; small (3 blocks): one thread, only the save streams. 3,007-byte
    ranges leave every store unaligned with a tail."""
    n = -(-shm_copy.THREAD_MIN_BYTES // (2 * layer_bytes)) + 3 if large else 3
    src = random_layers(2, (n, layer_bytes), torch.int8, seed=3)
    layout = BlockLayout.for_tensors(src)
    rng = np.random.default_rng(2)
    blocks, slots = rng.permutation(n), rng.permutation(n)
    images, loaded = [], []
    for impl in ("c", "torch"):
        with (
            checked_prefix("cvt") as prefix,
            ShmPool.create(prefix, n * layout.slot_stride) as pool,
        ):
            pool.segment_view(0)[:] = SENTINEL
            shm_copy.save_blocks(src, blocks, pool, slots, layout, 0, impl=impl)
            images.append(pool.segment_view(0).copy())
            dst = [torch.zeros_like(t) for t in src]
            shm_copy.load_blocks(dst, blocks[::-1].copy(), pool, slots, layout, 0, impl=impl)
            loaded.append(torch.cat(dst))
    assert np.array_equal(images[0], images[1])
    assert torch.equal(loaded[0], loaded[1])


def test_a_save_streams_at_any_size_a_load_only_past_stream_min_bytes():
    small, large = 128 << 10, shm_copy.STREAM_MIN_BYTES
    assert shm_copy.copy_settings(small, 2, save=True) == (1, True)
    assert shm_copy.copy_settings(small, 2, save=False) == (1, False)
    assert shm_copy.copy_settings(large, 2, save=False) == (1, True)
    assert shm_copy.copy_settings(shm_copy.THREAD_MIN_BYTES, 2, save=False) == (2, True)


@NEEDS_C
def test_blockcopy_extension_directly():
    from shm import _blockcopy

    rng = np.random.default_rng(5)
    src = rng.integers(0, 256, 1 << 16, dtype=np.uint8)
    for stream in (False, True):
        for size in (0, 1, 31, 33, 127, 129, 4097):
            dst = np.zeros_like(src)
            starts = rng.integers(0, src.size - size, 4).astype(np.uint64)
            outs = np.arange(4, dtype=np.uint64) * np.uint64(size + 7) + np.uint64(3)
            _blockcopy.copy(src.ctypes.data + starts, dst.ctypes.data + outs, size, 2, stream)
            for s, o in zip(starts.tolist(), outs.tolist(), strict=True):
                assert np.array_equal(dst[o : o + size], src[s : s + size])
    a = np.zeros(2, np.uint64)
    with pytest.raises(ValueError, match="same number"):
        _blockcopy.copy(a, np.zeros(3, np.uint64), 8)
    with pytest.raises(TypeError, match="uint64"):
        _blockcopy.copy(np.zeros(2, np.uint32), np.zeros(2, np.uint32), 8)
    with pytest.raises(ValueError, match="nbytes"):
        _blockcopy.copy(a, a, -1)
    with pytest.raises(ValueError, match="threads"):
        _blockcopy.copy(a, a, 8, 0)


@NEEDS_C
@pytest.mark.parametrize("save", [True, False])
@pytest.mark.parametrize("band", [1, 3, 64])
def test_copy_blocks_copies_every_block_and_layer_between_its_addresses(save, band):
    """Engine block ids[i] of layer l (starts[l] + ids[i] * strides[l]) <->
    slot i's piece l (slots[i] + slot_offsets[l]), for every i and l, in
    any band size; 5 blocks, 3 layers of 24 bytes with their own strides."""
    from shm import _blockcopy

    rng = np.random.default_rng(band + save)
    piece, layers, count = 24, 3, 5
    engine = [rng.integers(0, 256, (8, stride), dtype=np.uint8) for stride in (24, 40, 64)]
    slot_bytes = layers * piece + 8
    pool = rng.integers(0, 256, count * slot_bytes, dtype=np.uint8)
    ids = rng.permutation(8)[:count].astype(np.uint64)
    slots = np.uint64(pool.ctypes.data) + rng.permutation(count).astype(np.uint64) * np.uint64(
        slot_bytes
    )
    starts = np.array([t.ctypes.data for t in engine], np.uint64)
    strides = np.array([t.shape[1] for t in engine], np.uint64)
    offsets = np.arange(layers, dtype=np.uint64) * np.uint64(piece) + np.uint64(4)
    before_engine, before_pool = [t.copy() for t in engine], pool.copy()
    _blockcopy.copy_blocks(starts, strides, offsets, ids, slots, piece, save, band, 2)
    for i in range(count):
        at = int(slots[i]) - pool.ctypes.data
        for layer in range(layers):
            o = at + int(offsets[layer])
            engine_piece = engine[layer][int(ids[i]), :piece]
            if save:
                assert np.array_equal(
                    pool[o : o + piece], before_engine[layer][int(ids[i]), :piece]
                )
            else:
                assert np.array_equal(engine_piece, before_pool[o : o + piece])
    if save:  # nothing but the pieces written
        assert all(np.array_equal(a, b) for a, b in zip(engine, before_engine, strict=True))
    else:
        assert np.array_equal(pool, before_pool)


@NEEDS_C
def test_copy_blocks_refuses_bad_arguments_before_copying():
    from shm import _blockcopy

    three, two = np.zeros(3, np.uint64), np.zeros(2, np.uint64)
    with pytest.raises(ValueError, match="strides must hold 3"):
        _blockcopy.copy_blocks(three, two, three, two, two, 8, True, 1)
    with pytest.raises(ValueError, match="slots must hold 2"):
        _blockcopy.copy_blocks(three, three, three, two, three, 8, True, 1)
    with pytest.raises(TypeError, match="uint64"):
        _blockcopy.copy_blocks(three, three, three, np.zeros(2, np.uint32), two, 8, True, 1)
    with pytest.raises(ValueError, match="band"):
        _blockcopy.copy_blocks(three, three, three, two, two, 8, True, 0)
    with pytest.raises(ValueError, match="threads"):
        _blockcopy.copy_blocks(three, three, three, two, two, 8, True, 1, 0)
    # Empty: nothing to copy, nothing read.
    _blockcopy.copy_blocks(
        three, three, three, np.zeros(0, np.uint64), np.zeros(0, np.uint64), 8, True, 1
    )


def test_the_implementation_in_use_is_exposed():
    assert shm_copy.IMPL in shm_copy.IMPLS
    assert set(shm_copy.IMPLS) <= {"c", "torch"}


def test_without_the_extension_the_torch_loop_is_used():
    prefix = unique_prefix("noext")
    code = (
        "import sys; sys.modules['shm._blockcopy'] = None\n"
        "import numpy as np, torch\n"
        "from shm import copy\n"
        "from shm.layout import BlockLayout\n"
        "from shm.pool import ShmPool\n"
        "assert copy.IMPLS == ('torch',) and copy.IMPL == 'torch'\n"
        "kv = [torch.arange(40.0).reshape(4, 10)]\n"
        "out = [torch.zeros(4, 10)]\n"
        "layout = BlockLayout.for_tensors(kv)\n"
        f"with ShmPool.create({prefix!r}, 1 << 16) as pool:\n"
        "    copy.save_blocks(kv, np.array([2, 0]), pool, np.array([5, 1]), layout, 0)\n"
        "    copy.load_blocks(out, np.array([1, 3]), pool, np.array([5, 1]), layout, 0)\n"
        "assert torch.equal(out[0][[1, 3]], kv[0][[2, 0]])\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert shm_entries(prefix) == []


def test_an_empty_batch_copies_nothing(pool):
    layers = random_layers(2, (4, 8), torch.float32, seed=0)
    layout = BlockLayout.for_tensors(layers)
    for fn in (shm_copy.save_blocks, shm_copy.load_blocks):
        fn(layers, np.array([], np.int64), pool, [], layout, 0)
    assert (pool.segment_view(0) == SENTINEL).all()


@pytest.mark.parametrize("impl", shm_copy.IMPLS)
def test_padded_and_interleaved_blocks_copy_in_place(pool, impl):
    """Blocks need only be contiguous each: one layer of a cross-layer block
    (the layers interleaved block by block), and padded pages, copy from and
    to their own addresses; the memory between blocks is never touched."""
    gen = torch.Generator().manual_seed(3)
    cross = torch.randn(8, 2, 4, 6, generator=gen)  # [blocks, layers, ...]
    padded = torch.full((8, 30), -7.0)
    padded[:, :24] = torch.randn(8, 24, generator=gen)
    for layers in ([cross[:, 0], cross[:, 1]], [padded[:, :24].view(8, 4, 6)]):
        layout = BlockLayout.for_tensors(layers)
        shm_copy.save_blocks(layers, np.array([5, 2]), pool, np.array([1, 3]), layout, 0, impl=impl)
        view = pool.slot_view(3, layout.slot_stride)[: layout.block_bytes]
        assert np.array_equal(view, np.concatenate([raw(t[2]) for t in layers]))
        memory = torch.full((8, 2, 30), -7.0)
        back = [memory[:, i, :24].view(8, 4, 6) for i in range(len(layers))]
        shm_copy.load_blocks(back, np.array([0, 6]), pool, np.array([1, 3]), layout, 0, impl=impl)
        for t, b in zip(layers, back, strict=True):
            assert torch.equal(b[0], t[5]) and torch.equal(b[6], t[2])
            assert (b[[1, 2, 3, 4, 5, 7]] == -7).all()
        assert (memory[:, :, 24:] == -7).all() and (memory[:, len(layers) :] == -7).all()


def strided(t):
    """The same values as `t`, in a non-contiguous tensor of the same shape."""
    return t.transpose(1, 2).contiguous().transpose(1, 2)


# Each case: what to change in the good arguments, and the error it must raise.
BAD_INPUTS = {
    "layers not a list": (lambda a: a.update(kv=a["kv"][0]), TypeError),
    "a layer not a tensor": (lambda a: a["kv"].__setitem__(1, a["kv"][1].numpy()), TypeError),
    "too few layers": (lambda a: a.update(kv=a["kv"][:1]), ValueError),
    "meta device": (lambda a: a["kv"].__setitem__(1, a["kv"][1].to("meta")), ValueError),
    "not contiguous": (lambda a: a["kv"].__setitem__(1, strided(a["kv"][1])), ValueError),
    "blocks overlap": (
        lambda a: a["kv"].__setitem__(1, a["kv"][1].as_strided((8, 4, 2), (4, 2, 1))),
        ValueError,
    ),
    "dtype differs": (lambda a: a["kv"].__setitem__(1, a["kv"][1].view(torch.int32)), ValueError),
    "shape differs": (lambda a: a["kv"].__setitem__(1, a["kv"][1][:5]), ValueError),
    "block bytes differ": (lambda a: a.update(layout=BlockLayout(2, 64)), ValueError),
    "layout not a layout": (lambda a: a.update(layout=(2, 32)), TypeError),
    "blocks 2-D": (lambda a: a.update(blocks=a["blocks"].reshape(1, -1)), ValueError),
    "blocks float": (lambda a: a.update(blocks=a["blocks"].astype(float)), TypeError),
    "block out of range": (lambda a: a["blocks"].__setitem__(0, 8), ValueError),
    "negative block": (lambda a: a["blocks"].__setitem__(0, -1), ValueError),
    "lengths differ": (lambda a: a.update(slots=a["slots"][:2]), ValueError),
    "slot out of range": (lambda a: a["slots"].__setitem__(2, 10**6), ValueError),
    "slots float": (lambda a: a.update(slots=a["slots"].astype(np.float32)), TypeError),
    "rank out of range": (lambda a: a.update(rank=1), ValueError),
    "rank not an int": (lambda a: a.update(rank="0"), TypeError),
    "pool not a pool": (lambda a: a.update(pool=object()), TypeError),
    "unknown impl": (lambda a: a.update(impl="cuda"), ValueError),
    "bad threads": (lambda a: a.update(threads=0), ValueError),
}


@pytest.mark.parametrize("direction", ["save", "load"])
@pytest.mark.parametrize("case", [*BAD_INPUTS, "repeat", "closed pool"])
def test_bad_input_raises_and_copies_nothing(pool, direction, case):
    kv = random_layers(2, (8, 4, 2), torch.float32, seed=7)
    args = {
        "kv": list(kv),
        "blocks": np.array([1, 6, 3]),
        "pool": pool,
        "slots": np.array([4, 0, 9]),
        "layout": BlockLayout.for_tensors(kv),
        "rank": 0,
        "impl": None,
        "threads": None,
    }
    expected: type[Exception]
    if case == "repeat":  # a repeated destination is an error; a repeated source is fine
        key = "slots" if direction == "save" else "blocks"
        args[key][2] = args[key][0]
        expected = ValueError
    elif case == "closed pool":
        args["pool"] = ShmPool.attach(pool.segment_names, pool.segment_sizes)
        args["pool"].close()
        expected = ShmPoolError
    else:
        change, expected = BAD_INPUTS[case]
        change(args)
    fn = shm_copy.save_blocks if direction == "save" else shm_copy.load_blocks
    engine_before = [raw(t) for t in kv]
    with pytest.raises(expected):
        fn(
            args["kv"],
            args["blocks"],
            args["pool"],
            args["slots"],
            args["layout"],
            args["rank"],
            impl=args["impl"],
            threads=args["threads"],
        )
    assert (pool.segment_view(0) == SENTINEL).all()
    assert all(np.array_equal(raw(t), b) for t, b in zip(kv, engine_before, strict=True))


@pytest.mark.parametrize(
    ("ids", "repeats"),
    [([], False), ([7], False), ([1, 2, 3], False), ([3, 1, 2], False), ([1, 2, 2], True),
     ([5, 1, 5], True), ([2, 9, 4, 9, 0], True)],
)  # fmt: skip
def test_has_repeats_in_increasing_and_any_order(ids, repeats):
    assert shm_copy.has_repeats(np.array(ids, dtype=np.int64)) is repeats


@pytest.mark.parametrize("impl", shm_copy.IMPLS)
def test_a_layer_range_copies_those_layers_only_at_their_offsets(pool, impl):
    src = random_layers(3, (6, 4, 8), torch.float16, seed=7)
    layout = BlockLayout.for_tensors(src)
    blocks, slots = np.array([5, 1]), np.array([2, 0])
    shm_copy.save_blocks(src, blocks, pool, slots, layout, 0, impl=impl, layer_range=(1, 2))
    size = layout.layer_block_bytes
    for block, slot in zip(blocks, slots, strict=True):
        view = pool.slot_view(int(slot), layout.slot_stride)
        assert (view[:size] == SENTINEL).all() and (view[2 * size :] == SENTINEL).all()
        assert np.array_equal(view[size : 2 * size], raw(src[1][block]))
    back = [torch.zeros_like(t) for t in src]
    shm_copy.load_blocks(
        back, np.array([0, 3]), pool, slots, layout, 0, impl=impl, layer_range=(1, 2)
    )
    assert torch.equal(back[1][[0, 3]], src[1][blocks]) and not back[0].any() and not back[2].any()
    for bad in [(0, 0), (2, 4), (-1, 1), [0, 1], (0, True)]:
        with pytest.raises(ValueError, match="layer_range"):
            shm_copy.save_blocks(src, blocks, pool, slots, layout, 0, layer_range=bad)


@NEEDS_C
@pytest.mark.parametrize("layer_range", [None, (1, 3)])
def test_a_save_in_bands_writes_what_the_torch_loop_writes(monkeypatch, layer_range):
    """Bands of 3 blocks over 10 (three whole bands and one of 1), block ids
    and slots shuffled: every byte where the torch loop puts it."""
    src = random_layers(4, (10, 3, 8), torch.float16, seed=11)
    layout = BlockLayout.for_tensors(src)
    monkeypatch.setattr(shm_copy, "BAND_BYTES", 3 * layout.layer_block_bytes)
    rng = np.random.default_rng(5)
    blocks, slots = rng.permutation(10), rng.permutation(10)
    images = []
    for impl in ("c", "torch"):
        with (
            checked_prefix("band") as prefix,
            ShmPool.create(prefix, 10 * layout.slot_stride) as pool,
        ):
            pool.segment_view(0)[:] = SENTINEL
            shm_copy.save_blocks(
                src, blocks, pool, slots, layout, 0, impl=impl, layer_range=layer_range
            )
            images.append(pool.segment_view(0).copy())
    assert np.array_equal(images[0], images[1])
    assert (images[0] != SENTINEL).any()
