"""Block keys: chained 128-bit hashes of full token blocks, salted by namespace.

    key_i = H_k(key_{i-1} || tokens_i),   key_{-1} = root

where `H_k` is BLAKE2b with a 16-byte digest, keyed with a 32-byte chain key
derived from the namespace salt and the optional deployment secret, and the
root is a digest of the salt, the secret and the algorithm. The salt thus
enters every block twice (key and root), so two namespaces never share a key.

Tokens are hashed as little-endian int32 (`TOKEN_DTYPE`), whatever dtype the
caller holds them in; only the `len // tokens_per_block` full blocks get keys.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import xxhash

from contract.ids import KEY_BYTES, BlockKey, BlockKeys, as_keys

TOKEN_DTYPE = np.dtype("<i4")
MAX_TOKEN_ID = int(np.iinfo(TOKEN_DTYPE).max)
MAX_SECRET_BYTES = 64  # BLAKE2b's key limit
MIN_DIGEST_BYTES, MAX_DIGEST_BYTES = 16, 64
"""Lengths of engine block digests `KeyHasher.hash_digests` accepts."""

ChainFn = Callable[[bytes | memoryview, int, bytes, bytes], bytes]
"""(token bytes, block size in bytes, chain key, parent key) -> n * 16 key bytes."""


@dataclass(frozen=True)
class Namespace:
    """Everything that makes two KV blocks of the same tokens incompatible.

    `model_revision` is the weights revision or a fingerprint of them, so KV
    computed with old weights is never served for new ones. `tenant` is an
    optional salt that isolates tenants sharing one model.
    """

    model_name: str
    model_revision: str
    layout: str
    dtype: str
    tp_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    tokens_per_block: int
    tenant: str = ""

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.type == "str":
                if not isinstance(value, str):
                    raise ValueError(f"Namespace.{field.name} must be a str, got {value!r}")
                if not value and field.name != "tenant":
                    raise ValueError(f"Namespace.{field.name} must not be empty")
            elif isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"Namespace.{field.name} must be a positive int, got {value!r}")

    def salt(self) -> bytes:
        """32-byte digest of all fields (JSON with sorted keys, so unambiguous)."""
        encoded = json.dumps(
            dataclasses.asdict(self), sort_keys=True, separators=(",", ":"), ensure_ascii=False
        ).encode()
        return hashlib.blake2b(encoded, digest_size=32, person=b"kvsidecar.ns.v1").digest()


def canonical_tokens(token_ids: Sequence[int] | np.ndarray) -> np.ndarray:
    """Token ids as a 1-D little-endian int32 array (a copy only if needed).

    Raises ValueError for non-1-D input, non-integer dtypes, and ids outside
    [0, MAX_TOKEN_ID].
    """
    try:
        arr = np.asarray(token_ids)
    except OverflowError as exc:
        raise ValueError(f"token ids must be in [0, {MAX_TOKEN_ID}]: {exc}") from None
    if arr.ndim != 1:
        raise ValueError(f"token_ids must be 1-D, got shape {arr.shape}")
    if arr.size == 0:
        return np.empty(0, dtype=TOKEN_DTYPE)
    if arr.dtype.kind not in "iu":
        raise ValueError(
            f"token ids must be integers in [0, {MAX_TOKEN_ID}], got dtype {arr.dtype}"
        )
    if _out_of_range(arr):
        if arr.dtype.kind == "i" and arr.min() < 0:
            bad = int(np.flatnonzero(arr < 0)[0])
            raise ValueError(f"token ids must be non-negative, got {arr[bad]} at index {bad}")
        bad = int(np.flatnonzero(arr > MAX_TOKEN_ID)[0])
        raise ValueError(f"token ids must be <= {MAX_TOKEN_ID}, got {arr[bad]} at index {bad}")
    return np.ascontiguousarray(arr, dtype=TOKEN_DTYPE)


def _out_of_range(arr: np.ndarray) -> bool:
    """Any id outside [0, MAX_TOKEN_ID], in one pass over `arr` (integers): ids
    of 4 or more bytes are read as unsigned, so a negative one reads as huge."""
    if arr.dtype.itemsize < 4:
        return arr.dtype.kind == "i" and bool(arr.min() < 0)
    unsigned = arr if arr.dtype.kind == "u" else arr.view(arr.dtype.str.replace("i", "u"))
    return bool(unsigned.max() > MAX_TOKEN_ID)


def blake2b_chain_python(
    data: bytes | memoryview, block_bytes: int, key: bytes, parent: bytes
) -> bytes:
    """Pure-Python (hashlib) chain; the reference for the C accelerator."""
    new = hashlib.blake2b(key=key, digest_size=KEY_BYTES).copy  # key block compressed once
    view = memoryview(data)
    keys: list[bytes] = []
    append = keys.append
    for start in range(0, len(data) // block_bytes * block_bytes, block_bytes):
        h = new()
        h.update(parent)
        h.update(view[start : start + block_bytes])
        parent = h.digest()
        append(parent)
    return b"".join(keys)


def xxh3_128_chain(data: bytes | memoryview, block_bytes: int, key: bytes, parent: bytes) -> bytes:
    """xxh3_128 chain seeded from the chain key. Fast, but NOT collision resistant.

    Anyone who can choose tokens can build collisions (the 64-bit seed does not
    stop that), so one tenant could poison another's prefixes. Use it only
    where every token sequence comes from a trusted party.
    """
    seed = int.from_bytes(key[:8], "little")
    digest = xxhash.xxh3_128_digest
    view = memoryview(data)
    keys: list[bytes] = []
    append = keys.append
    for start in range(0, len(data) // block_bytes * block_bytes, block_bytes):
        parent = digest(parent + view[start : start + block_bytes], seed)
        append(parent)
    return b"".join(keys)


BLAKE2B_CHAINS: dict[str, ChainFn] = {"python": blake2b_chain_python}
TokenChainFn = Callable[[np.ndarray, int, int, bytes, bytes], bytes]
"""(token ids, bytes per id, tokens per block, chain key, parent key) -> key bytes."""
_token_chain: TokenChainFn | None = None
try:
    from contract import _blake2chain

    BLAKE2B_CHAINS["c"] = _blake2chain.chain
    _token_chain = _blake2chain.chain_tokens
except ImportError:  # built without a C compiler: hashlib is ~2-3x slower
    pass
_DIRECT_DTYPES = frozenset(np.dtype(t) for t in (np.int64, np.int32, np.uint64, np.uint32))
"""Token id dtypes the C chain reads as they are (range-checked and narrowed in one
pass), so the usual int64 ids of an engine cost no int32 copy or numpy reductions."""
BLAKE2B_IMPL = "c" if "c" in BLAKE2B_CHAINS else "python"
"""The blake2b implementation a KeyHasher uses by default."""

ALGORITHMS = ("blake2b", "xxh3_128")


class KeyHasher:
    """Turns token ids into the chained block keys of one namespace.

    `secret` (at most 64 bytes) is a deployment key: without it nobody can
    precompute or probe keys. `algorithm` is "blake2b" (collision resistant,
    the default) or "xxh3_128" (fast, trusted input only; see xxh3_128_chain).
    `impl` picks the blake2b implementation ("c" or "python"); both give
    identical keys, and the default is the fastest one available.

    Keys depend only on (namespace, secret, algorithm, tokens): two instances
    built from equal arguments give equal keys, in any process.
    """

    def __init__(
        self,
        namespace: Namespace,
        secret: bytes = b"",
        algorithm: str = "blake2b",
        *,
        impl: str | None = None,
    ) -> None:
        if algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
        if not isinstance(secret, bytes) or len(secret) > MAX_SECRET_BYTES:
            raise ValueError(f"secret must be bytes of at most {MAX_SECRET_BYTES} bytes")
        if algorithm == "blake2b":
            impl = impl or BLAKE2B_IMPL
            if impl not in BLAKE2B_CHAINS:
                raise ValueError(f"blake2b impl must be one of {sorted(BLAKE2B_CHAINS)}")
            self._chain = BLAKE2B_CHAINS[impl]
            self._token_chain = _token_chain if impl == "c" else None
        else:
            if impl not in (None, "xxhash"):
                raise ValueError("xxh3_128 has a single impl, 'xxhash'")
            impl, self._chain, self._token_chain = "xxhash", xxh3_128_chain, None
        self.namespace = namespace
        self.algorithm = algorithm
        self.impl = impl
        self.tokens_per_block = namespace.tokens_per_block
        self._block_bytes = namespace.tokens_per_block * TOKEN_DTYPE.itemsize
        salt = namespace.salt()
        self._chain_key = hashlib.blake2b(
            salt, key=secret, digest_size=32, person=b"kvsidecar.chain"
        ).digest()
        # The algorithm is part of the root, so the two algorithms' chains never meet.
        self.root = BlockKey(
            hashlib.blake2b(
                salt + algorithm.encode(),
                key=secret,
                digest_size=KEY_BYTES,
                person=b"kvsidecar.root",
            ).digest()
        )
        # Chains of engine digests start elsewhere, so they never meet token chains.
        self.digest_root = BlockKey(
            hashlib.blake2b(
                self.root, key=secret, digest_size=KEY_BYTES, person=b"kvsidecar.digest"
            ).digest()
        )

    def hash_tokens(
        self, token_ids: Sequence[int] | np.ndarray, parent: BlockKey | None = None
    ) -> BlockKeys:
        """Keys of the `len(token_ids) // tokens_per_block` full blocks (read-only array).

        `parent` is the key of the block just before `token_ids` (None: they
        start the sequence), so hashing blocks i.. with parent key_{i-1} gives
        the same keys as hashing the whole sequence. Raises ValueError for bad
        tokens (see `canonical_tokens`) or a parent that is not 16 bytes.
        """
        start = self.root if parent is None else _parent_bytes(parent)
        direct = self._token_chain
        if (
            direct is not None
            and type(token_ids) is np.ndarray
            and token_ids.ndim == 1
            and token_ids.dtype in _DIRECT_DTYPES
            and token_ids.flags.c_contiguous
        ):
            try:
                tpb, itemsize = self.tokens_per_block, token_ids.itemsize
                return as_keys(direct(token_ids, itemsize, tpb, self._chain_key, start))
            except OverflowError:
                pass  # an id out of range: canonical_tokens names it
        tokens = canonical_tokens(token_ids)
        n = tokens.size // self.tokens_per_block
        data = tokens[: n * self.tokens_per_block].data.cast("B")  # a memoryview: no copy
        return as_keys(self._chain(data, self._block_bytes, self._chain_key, start))

    def hash_digests(self, digests: Sequence[bytes], parent: BlockKey | None = None) -> BlockKeys:
        """Keys of blocks an engine already names by digests of its own (vLLM's
        block hashes: chained, one per full block of tokens_per_block tokens).

        The digests are chained again under this namespace's chain key, from a
        root of their own, so these keys never equal token keys and never leave
        the namespace; they are only as collision resistant as the engine's
        digests. All digests have one length of 16 to 64 bytes (ValueError
        otherwise). `parent` works as in `hash_tokens`.
        """
        raw = [_digest_bytes(d, i) for i, d in enumerate(digests)]
        if not raw:
            return as_keys(b"")
        size = len(raw[0])
        if not MIN_DIGEST_BYTES <= size <= MAX_DIGEST_BYTES or any(len(d) != size for d in raw):
            lengths = sorted({len(d) for d in raw})
            raise ValueError(
                f"block digests must all have one length of {MIN_DIGEST_BYTES} to "
                f"{MAX_DIGEST_BYTES} bytes, got lengths {lengths}"
            )
        start = self.digest_root if parent is None else _parent_bytes(parent)
        return as_keys(self._chain(b"".join(raw), size, self._chain_key, start))


def _digest_bytes(digest: object, index: int) -> bytes:
    if not isinstance(digest, bytes | bytearray | memoryview):
        raise ValueError(f"block digest {index} must be bytes, got {type(digest).__name__}")
    return bytes(digest)


def _parent_bytes(parent: object) -> bytes:
    try:
        raw = memoryview(parent).tobytes()  # type: ignore[arg-type]
    except TypeError:
        raise ValueError(f"parent must be a {KEY_BYTES}-byte key, got {parent!r}") from None
    if len(raw) != KEY_BYTES:
        raise ValueError(f"parent must be a {KEY_BYTES}-byte key, got {len(raw)} bytes")
    return raw
