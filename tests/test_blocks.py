"""Block keys: chaining, continuation, namespace isolation, and the C/hashlib agreement."""

from __future__ import annotations

import dataclasses
import hashlib
import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from contract import blocks
from contract.blocks import MAX_TOKEN_ID, KeyHasher, Namespace
from contract.ids import KEY_BYTES, KEY_DTYPE, as_keys, key_at

TPB = 4
NS = Namespace(
    model_name="llama-3-8b",
    model_revision="abc123",
    layout="flash_attn",
    dtype="bfloat16",
    tp_size=1,
    num_layers=32,
    num_kv_heads=8,
    head_dim=128,
    tokens_per_block=TPB,
)

# Every way to hash: both blake2b implementations and xxh3_128.
HASHERS = [("blake2b", "python"), ("blake2b", "c"), ("xxh3_128", None)]


@pytest.fixture(params=HASHERS, ids=lambda p: f"{p[0]}-{p[1] or 'xxhash'}")
def hasher(request: pytest.FixtureRequest) -> KeyHasher:
    algorithm, impl = request.param
    return KeyHasher(NS, algorithm=algorithm, impl=impl)


def key_list(keys: np.ndarray) -> list[bytes]:
    return [key_at(keys, i) for i in range(len(keys))]


def tokens(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 150_000, n, dtype=np.int64)


def test_c_extension_is_built() -> None:
    assert "c" in blocks.BLAKE2B_CHAINS, "build it with `pip install -e .` (needs a C compiler)"
    assert blocks.BLAKE2B_IMPL == "c"


@pytest.mark.parametrize("impl", ["python", "c"])
@pytest.mark.parametrize("key_len", [0, 1, 32, 64])
@pytest.mark.parametrize("block_bytes", [1, 8, 64, 111, 112, 113, 240, 1000])
def test_chain_matches_hashlib(impl: str, key_len: int, block_bytes: int) -> None:
    rng = np.random.default_rng(key_len * 10_000 + block_bytes)
    key = rng.bytes(key_len)
    parent = rng.bytes(KEY_BYTES)
    data = rng.bytes(block_bytes * 5 + 3)
    expected, prev = [], parent
    for i in range(len(data) // block_bytes):
        block = data[i * block_bytes : (i + 1) * block_bytes]
        prev = hashlib.blake2b(prev + block, key=key, digest_size=16).digest()
        expected.append(prev)
    assert blocks.BLAKE2B_CHAINS[impl](data, block_bytes, key, parent) == b"".join(expected)


def test_c_equals_python_on_random_inputs() -> None:
    c, py = blocks.BLAKE2B_CHAINS["c"], blocks.BLAKE2B_CHAINS["python"]
    for _ in range(50):
        block_bytes = int.from_bytes(os.urandom(1), "little") + 1
        data = os.urandom(int.from_bytes(os.urandom(2), "little") % 4096)
        key = os.urandom(int.from_bytes(os.urandom(1), "little") % 65)
        parent = os.urandom(KEY_BYTES)
        assert c(data, block_bytes, key, parent) == py(data, block_bytes, key, parent)


@pytest.mark.parametrize("dtype", [np.int64, np.int32, np.uint64, np.uint32])
@pytest.mark.parametrize("tpb", [1, 4, 16, 28, 29, 33])
def test_ids_hashed_as_they_are_give_the_int32_copys_keys(dtype: type, tpb: int) -> None:
    """The C chain reads int32/int64 ids in place; the Python impl hashes an
    int32 copy. Same keys for every length (tails included) and parent, on
    both C paths: up to 28 ids a block fit one compression with the parent
    key (message words built from the ids), more take the byte-buffer path."""
    ns = dataclasses.replace(NS, tokens_per_block=tpb)
    direct, copied = KeyHasher(ns, impl="c"), KeyHasher(ns, impl="python")
    assert direct._token_chain is not None  # the path under test is taken
    rng = np.random.default_rng(tpb)
    for n in (0, 1, tpb - 1, tpb, 7 * tpb + 3):
        ids = rng.integers(0, MAX_TOKEN_ID, n, endpoint=True).astype(dtype)
        ids[: min(n, 2)] = (0, MAX_TOKEN_ID)[: min(n, 2)]  # both ends of the range
        for parent in (None, direct.root, b"\x07" * KEY_BYTES):
            assert key_list(direct.hash_tokens(ids, parent)) == key_list(
                copied.hash_tokens(ids, parent)
            )


def test_only_full_blocks_are_keyed(hasher: KeyHasher) -> None:
    for n in (0, 1, TPB - 1, TPB, TPB + 1, 5 * TPB - 1, 5 * TPB):
        keys = hasher.hash_tokens(tokens(n))
        assert keys.shape == (n // TPB,)
        assert keys.dtype == KEY_DTYPE
    full = hasher.hash_tokens(tokens(3 * TPB + 2))
    assert key_list(full) == key_list(hasher.hash_tokens(tokens(3 * TPB + 2)[: 3 * TPB]))


def test_changing_a_block_changes_it_and_every_later_key(hasher: KeyHasher) -> None:
    base = tokens(8 * TPB)
    before = key_list(hasher.hash_tokens(base))
    assert len(set(before)) == len(before)
    for j in range(8):
        changed = base.copy()
        changed[j * TPB + 1] += 1
        after = key_list(hasher.hash_tokens(changed))
        assert after[:j] == before[:j]
        assert all(a != b for a, b in zip(after[j:], before[j:], strict=True))


def test_parent_continues_the_chain(hasher: KeyHasher) -> None:
    seq = tokens(10 * TPB + 3)
    whole = key_list(hasher.hash_tokens(seq))
    for i in range(1, 10):
        rest = hasher.hash_tokens(seq[i * TPB :], parent=key_at(hasher.hash_tokens(seq), i - 1))
        assert key_list(rest) == whole[i:]


def test_parent_none_starts_at_root_and_differs_from_a_parent(hasher: KeyHasher) -> None:
    seq = tokens(2 * TPB)
    assert key_list(hasher.hash_tokens(seq)) == key_list(hasher.hash_tokens(seq, hasher.root))
    other = hasher.hash_tokens(seq, parent=bytes(KEY_BYTES))
    assert key_list(other) != key_list(hasher.hash_tokens(seq))


def _variants() -> list[Namespace]:
    changes = {
        "model_name": "llama-3-70b",
        "model_revision": "def456",
        "layout": "flashinfer",
        "dtype": "float16",
        "tp_size": 2,
        "num_layers": 33,
        "num_kv_heads": 4,
        "head_dim": 64,
        "tokens_per_block": TPB * 2,
        "tenant": "acme",
    }
    assert set(changes) == {f.name for f in dataclasses.fields(Namespace)}
    return [NS] + [dataclasses.replace(NS, **{k: v}) for k, v in changes.items()]


@pytest.mark.parametrize("algorithm", ["blake2b", "xxh3_128"])
def test_distinct_namespaces_give_distinct_keys(algorithm: str) -> None:
    seq = tokens(16 * TPB)
    seen: set[bytes] = set()
    for ns in _variants():
        keys = key_list(KeyHasher(ns, algorithm=algorithm).hash_tokens(seq))
        assert not seen.intersection(keys)
        seen.update(keys)


def test_salt_is_unambiguous() -> None:
    a = dataclasses.replace(NS, model_name="ab", model_revision="c")
    b = dataclasses.replace(NS, model_name="a", model_revision="bc")
    assert a.salt() != b.salt()
    assert NS.salt() == dataclasses.replace(NS).salt()
    assert len(NS.salt()) == 32


def test_secret_and_algorithm_change_keys() -> None:
    seq = tokens(4 * TPB)
    plain = key_list(KeyHasher(NS).hash_tokens(seq))
    secret = key_list(KeyHasher(NS, secret=b"s" * 32).hash_tokens(seq))
    other = key_list(KeyHasher(NS, secret=b"t" * 32).hash_tokens(seq))
    fast = key_list(KeyHasher(NS, algorithm="xxh3_128").hash_tokens(seq))
    assert len(set(plain + secret + other + fast)) == 4 * 4
    assert KeyHasher(NS).root != KeyHasher(NS, algorithm="xxh3_128").root


def test_deterministic_across_instances(hasher: KeyHasher) -> None:
    seq = tokens(6 * TPB)
    again = KeyHasher(NS, algorithm=hasher.algorithm, impl=hasher.impl)
    assert key_list(hasher.hash_tokens(seq)) == key_list(again.hash_tokens(seq))
    assert hasher.root == again.root


@pytest.mark.parametrize("impl", ["python", "c"])
def test_known_answer(impl: str) -> None:
    # Pins the key derivation: a change here invalidates every stored block.
    keys = KeyHasher(NS, secret=b"k", impl=impl).hash_tokens(list(range(2 * TPB)))
    assert keys.tobytes().hex() == (
        "d1ab2f3b32202c748230a0defeff3ce9d6ed439b4f73369bd932d0caf2285a59"
    )


def test_dtype_independence(hasher: KeyHasher) -> None:
    seq = tokens(5 * TPB)
    expected = key_list(hasher.hash_tokens(seq))
    for variant in (
        seq.astype(np.int32),
        seq.astype(np.uint32),
        seq.astype(">i8"),
        seq.astype(np.uint64),
        seq[::-1].copy()[::-1],  # non-contiguous view
        seq.tolist(),
        tuple(int(t) for t in seq),
    ):
        assert key_list(hasher.hash_tokens(variant)) == expected


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        (np.zeros((2, TPB), dtype=np.int64), "1-D"),
        (np.int64(5), "1-D"),
        ([1, -2, 3], "non-negative"),
        (np.array([0.0, 1.0, 2.0, 3.0]), "integers"),
        (np.array([True] * TPB), "integers"),
        ([MAX_TOKEN_ID + 1], "<= 2147483647"),
        (np.array([2**40], dtype=np.int64), "<= 2147483647"),
        ([2**64 + 1], "2147483647"),
        (["a", "b"], "integers"),
    ],
)
def test_bad_tokens_are_rejected(bad: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        KeyHasher(NS).hash_tokens(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", ["i1", "u1", "i2", "u2", "<i4", ">i4", "u4", "<i8", ">i8", "u8"])
def test_token_range_is_checked_for_every_integer_width(dtype: str) -> None:
    info = np.iinfo(np.dtype(dtype))
    top = min(int(info.max), MAX_TOKEN_ID)
    ok = np.array([0, 1, top] * TPB, dtype=dtype)[:TPB]
    assert key_list(KeyHasher(NS).hash_tokens(ok)) == key_list(
        KeyHasher(NS).hash_tokens(ok.astype(np.int64))
    )
    if info.min < 0:
        with pytest.raises(ValueError, match="non-negative, got -1 at index 2"):
            KeyHasher(NS).hash_tokens(np.array([3, 4, -1, 5], dtype=dtype))
    if info.max > MAX_TOKEN_ID:
        bad = np.array([3, 4, MAX_TOKEN_ID + 1, 5], dtype=dtype)
        with pytest.raises(
            ValueError, match=f"<= {MAX_TOKEN_ID}, got {MAX_TOKEN_ID + 1} at index 2"
        ):
            KeyHasher(NS).hash_tokens(bad)


def test_largest_token_id_is_accepted() -> None:
    assert KeyHasher(NS).hash_tokens([MAX_TOKEN_ID] * TPB).shape == (1,)


@pytest.mark.parametrize("parent", [b"short", b"x" * 17, 7, "a" * 16])
def test_bad_parent_is_rejected(parent: object) -> None:
    with pytest.raises(ValueError, match="parent"):
        KeyHasher(NS).hash_tokens(tokens(TPB), parent=parent)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "change",
    [
        {"model_name": ""},
        {"model_revision": ""},
        {"layout": ""},
        {"dtype": ""},
        {"tp_size": 0},
        {"num_layers": -1},
        {"num_kv_heads": 0},
        {"head_dim": 0},
        {"tokens_per_block": 0},
        {"tokens_per_block": True},
        {"head_dim": 64.0},
        {"model_name": 3},
    ],
)
def test_bad_namespace_is_rejected(change: dict[str, object]) -> None:
    with pytest.raises(ValueError, match=next(iter(change))):
        dataclasses.replace(NS, **change)


def test_bad_hasher_arguments_are_rejected() -> None:
    with pytest.raises(ValueError, match="algorithm"):
        KeyHasher(NS, algorithm="md5")
    with pytest.raises(ValueError, match="secret"):
        KeyHasher(NS, secret=b"x" * 65)
    with pytest.raises(ValueError, match="impl"):
        KeyHasher(NS, impl="rust")


@settings(max_examples=200, deadline=None)
@given(
    seq=st.lists(st.integers(0, MAX_TOKEN_ID), max_size=12 * TPB),
    split_block=st.integers(0, 12),
    hasher_args=st.sampled_from(HASHERS),
)
def test_continuation_law(seq: list[int], split_block: int, hasher_args: tuple) -> None:
    algorithm, impl = hasher_args
    hasher = KeyHasher(NS, algorithm=algorithm, impl=impl)
    whole = hasher.hash_tokens(seq)
    split = min(split_block, len(whole))
    head = hasher.hash_tokens(seq[: split * TPB])
    parent = key_at(head, split - 1) if split else None
    tail = hasher.hash_tokens(seq[split * TPB :], parent=parent)
    assert key_list(head) + key_list(tail) == key_list(whole)


# ---- keys from an engine's own block digests (vLLM's block hashes) ---------------------


def _digests(n: int, salt: bytes = b"") -> list[bytes]:
    return [hashlib.sha256(salt + bytes([i])).digest() for i in range(n)]


def test_digest_keys_chain_like_token_keys(hasher: KeyHasher) -> None:
    keys = hasher.hash_digests(_digests(5))
    assert keys.dtype == KEY_DTYPE and len(keys) == 5
    assert np.array_equal(hasher.hash_digests(_digests(5)[3:], parent=key_at(keys, 2)), keys[3:])
    changed = hasher.hash_digests([*_digests(5)[:2], b"\xff" * 32, *_digests(5)[3:]])
    assert np.array_equal(changed[:2], keys[:2])
    assert not np.isin(changed[2:], keys).any()  # one digest changes it and every later key
    assert len(hasher.hash_digests([])) == 0


def test_digest_keys_never_meet_token_keys_or_other_namespaces(hasher: KeyHasher) -> None:
    # 32-byte digests are the bytes of 8 int32 tokens: same input, other root.
    tokens = np.frombuffer(b"".join(_digests(2)), dtype="<i4") & 0x7FFFFFFF
    digests = [tokens[:8].astype("<i4").tobytes(), tokens[8:].astype("<i4").tobytes()]
    wide = KeyHasher(dataclasses.replace(NS, tokens_per_block=8), algorithm=hasher.algorithm)
    assert not np.isin(wide.hash_digests(digests), wide.hash_tokens(tokens)).any()
    other = KeyHasher(dataclasses.replace(NS, tenant="other"), algorithm=hasher.algorithm)
    assert not np.isin(other.hash_digests(_digests(3)), hasher.hash_digests(_digests(3))).any()


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        ([b"a" * 32, b"b" * 16], "one length"),
        ([b"a" * 8], "one length"),
        ([b"a" * 65], "one length"),
        (["text" * 8], "must be bytes"),
        ([None], "must be bytes"),
    ],
)
def test_bad_digests_are_rejected(bad: list, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        KeyHasher(NS).hash_digests(bad)


@pytest.mark.parametrize(
    "make", [bytes, bytearray, memoryview, lambda b: np.frombuffer(b, np.uint8)]
)
def test_as_keys_views_every_kind_of_key_bytes_and_refuses_a_ragged_length(make) -> None:
    raw = os.urandom(3 * KEY_BYTES)
    keys = as_keys(make(raw))
    assert keys.dtype == KEY_DTYPE and key_list(keys) == [
        raw[i : i + KEY_BYTES] for i in range(0, len(raw), KEY_BYTES)
    ]
    with pytest.raises(ValueError, match=f"multiple of {KEY_BYTES}"):
        as_keys(make(raw[:-1]))


def test_chain_tokens_refuses_bad_arguments() -> None:
    chain_tokens = blocks._token_chain
    assert chain_tokens is not None
    ids, key, parent = np.arange(8), b"", bytes(KEY_BYTES)
    for args, error, match in [
        ((ids, 3, 4, key, parent), ValueError, "whole ids"),
        ((b"abc", 4, 1, key, parent), ValueError, "whole ids"),
        ((ids, 8, 0, key, parent), ValueError, "tokens_per_block"),
        ((ids, 8, 4, bytes(65), parent), ValueError, "key"),
        ((ids, 8, 4, key, bytes(15)), ValueError, "parent"),
        ((np.array([1, -1]), 8, 1, key, parent), OverflowError, "outside"),
        ((np.array([2**31], np.uint32), 4, 1, key, parent), OverflowError, "outside"),
    ]:
        with pytest.raises(error, match=match):
            chain_tokens(*args)
