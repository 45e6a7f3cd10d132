"""The engine's side of the hot index: lookups, CPU-hit loads and saves
without a round trip (the sidecar's side: sidecar/server/hotpath.py; the
table: shm/hotindex.py).

- A lookup hashes the prompt a chunk at a time (2 blocks, then 16, 128, ...:
  each chunk's parent is the last key of the one before) and probes each
  chunk in the mapped table, stopping at the first block that is not ready
  in the CPU tier: a prompt whose first block misses costs one short hash
  and one probe, whatever its length.
- A load finds each block's (slot, generation), copies the slots into the
  engine's blocks, then checks the generations again: the blocks from the
  first whose slot was vacated meanwhile on are a miss (a partial load),
  and no byte of another block is ever used as this one's.
- What they did reaches the sidecar in batches, never awaited (`Touch`):
  lookups for its hit ratios, loaded prefixes for the eviction policy's
  recency, and, for a policy that learns from requests (flag OBSERVED:
  `auto`), each lookup's whole key chain. A lookup that stopped at a miss
  leaves the rest of its prompt to a thread of the client's (`Tails`), which
  hashes it off the lookup's path.
- A save copies the blocks the CPU tier lacks into slots granted ahead
  (`Grant`) and commits them in one message (`Commit`).

`HotPath`: one mapped table and its batch; `HotLane`: a `KVClient`'s use of it.

A table is trusted only while it is open and its writer stamped it within
the client's timeout: a stopped or killed sidecar's table serves nothing.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from contract import protocol as p
from contract.blocks import KeyHasher, canonical_tokens
from contract.ids import KEY_BYTES, BlockKey, BlockKeys, key_bytes
from cuda_ext.copier import BlockCopier, CpuBlockCopier
from engine_shim.channel import Channel, SidecarError, SidecarUnavailable
from engine_shim.transfer import LayeredTransfer, TransferHandle
from shm import hotindex
from shm.hotindex import HotIndexView
from shm.layout import BlockLayout
from shm.pool import ShmPoolError

FIRST_CHUNK = 2
"""Blocks hashed before the first probe; each later chunk is 8x the last."""
TOUCH_BATCH = 256
"""Lookups or loads kept before a Touch goes, at the latest."""
GRANT_LOW = 32
"""Fewer granted slots than this: ask for more (unawaited); after an answer
with fewer than asked, fewer than half of those then held."""
GRANT_IDLE_SECONDS = 10.0
"""A rank that took no granted slot for this long gives its grant back
(`HotLane.take_release`): the space is then free for other geometries."""
GRANT_WANT = 64
"""Slots one Grant asks for."""
TOUCH_SECONDS = 0.05
"""A Touch goes with the next call once its oldest entry is this old."""
MAX_TAILS = 256
"""Lookups' tails waiting to be hashed at most; later ones are not observed."""


class Tails:
    """The thread that hashes what lookups left unhashed past their first
    miss, for the sidecar's `auto` policy (whose shadows need every lookup's
    whole chain); each finished chain goes to `done`. Started with the first
    tail. The C key chain releases the GIL while it hashes."""

    def __init__(self, done: Callable[[bytes], None]) -> None:
        self._done = done
        self._queue: collections.deque[tuple[bytes, np.ndarray, KeyHasher]] = collections.deque()
        self._wake = threading.Event()
        self._stopped = False
        self._thread: threading.Thread | None = None
        self.dropped = 0
        """Tails not observed: the queue was full, or a token id in one was
        out of range (the lookup stopped before it, so nobody was told)."""

    def add(self, head: bytes, tokens: np.ndarray, hasher: KeyHasher) -> None:
        """Hash `tokens` (a copy the thread owns) as the blocks after the
        keys `head`, then hand over the whole chain."""
        if len(self._queue) >= MAX_TAILS or self._stopped:
            self.dropped += 1
            return
        self._queue.append((head, tokens, hasher))
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kvsidecar-tails", daemon=True)
            self._thread.start()
        self._wake.set()

    def _run(self) -> None:
        queue = self._queue
        while not self._stopped:
            self._wake.wait()
            self._wake.clear()
            while queue and not self._stopped:
                head, tokens, hasher = queue.popleft()
                parent = BlockKey(head[-KEY_BYTES:]) if head else None
                try:
                    rest = hasher.hash_tokens(tokens, parent)
                except ValueError:  # an id the lookup never read is out of range
                    self.dropped += 1
                    continue
                self._done(head + key_bytes(rest))

    def stop(self) -> None:
        self._stopped = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=2.0)


class HotPath:
    """One mapped hot index, and the batch of what was done through it."""

    def __init__(self, name: str) -> None:
        """Raises ShmPoolError (gone) or ValueError (not a table)."""
        self.view = HotIndexView(name)
        self.name = name
        self._lookups: list[int] = []
        """(blocks asked, CPU hit blocks) per lookup, flat."""
        self._loads: list[bytes] = []
        self._load_skip: list[int] = []
        self._seen: list[bytes] = []
        """Observed lookups' whole chains (flag OBSERVED)."""
        self.tails = Tails(self.note_seen)
        self._since = 0.0
        self._lock = threading.Lock()
        """The batch is taken by the heartbeat's thread too."""
        self.granted: list[int] = []
        """CPU slots the sidecar granted this rank for its saves, unused
        (changed under the lock: the heartbeat's thread gives them back
        when idle, `take_idle_grant`)."""
        self.boot_id = ""
        """The boot of the sidecar whose index this is (its grants' too)."""
        self.last_taken = time.monotonic()
        """When a save last took granted slots (or the index was mapped)."""
        self.grant_request: int | None = None
        """The id of a Grant request whose reply has not been read yet."""
        self.in_flight = 0
        """Saves that took granted slots of this `epoch` and have not
        committed them yet."""
        self.epoch = 0
        """Grants given up by the sidecar so far (`clear_granted`): slots
        taken before, given back after it, are not this rank's any more."""
        self.grant_low = GRANT_LOW
        """Fewer granted slots than this: ask for more (GRANT_LOW)."""

    def flags(self, max_age: float) -> int:
        """The table's flags while it can be trusted (open, and stamped within
        `max_age` seconds), else 0."""
        state = self.view.state()
        if not state.flags & hotindex.OPEN or state.age > max_age:
            return 0
        return state.flags

    def count(
        self, hasher: KeyHasher, tokens: np.ndarray, observe: bool = False, tails: bool = False
    ) -> tuple[int, int]:
        """(leading blocks ready in the CPU tier, full blocks of `tokens`),
        hashing no further than the first block that is not. With `observe`
        the whole chain of a lookup that hit every block is noted for the
        sidecar; with `tails` too, that of one that missed, its rest hashed
        by `tails`."""
        tpb = hasher.tokens_per_block
        total = tokens.size // tpb
        done, chunk = 0, FIRST_CHUNK
        parent: BlockKey | None = None
        hashed: list[bytes] = []
        while done < total:
            n = min(chunk, total - done)
            kb = key_bytes(hasher.hash_tokens(tokens[done * tpb : (done + n) * tpb], parent))
            hashed.append(kb)
            found = self.view.count(kb)
            if found < n:
                if tails:
                    rest = tokens[(done + n) * tpb : total * tpb]
                    if rest.size >= tpb:
                        self.tails.add(b"".join(hashed), rest.copy(), hasher)
                    else:
                        self.note_seen(b"".join(hashed))
                return done + found, total
            done += n
            parent, chunk = BlockKey(kb[-KEY_BYTES:]), chunk * 8
        if observe and total:
            self.note_seen(b"".join(hashed))
        return done, total

    def load(
        self,
        copier: BlockCopier,
        layout: BlockLayout,
        keys: bytes,
        blocks: np.ndarray,
        skip: int,
        lower_tiers: bool,
    ) -> int | None:
        """Copy the CPU hits of `keys` past the first `skip` into engine
        blocks `blocks[skip:]` straight from the pool, checked by generation;
        the blocks loaded (past `skip`). None if the sidecar must plan it: TP
        (every rank copies its shard of one plan), or a CPU miss where a
        lower tier may hold the block."""
        if layout.tp_size != 1:
            return None
        kb = keys[skip * KEY_BYTES :]
        slots, gens = self.view.find(kb)
        found = len(slots)
        if found < len(kb) // KEY_BYTES and lower_tiers:
            return None
        if found:
            copier.load(blocks[skip : skip + found], slots, layout, 0).synchronize()
            found = self.view.check(slots, gens)  # from a vacated slot on: a miss
        if found:  # the chain from its first block: the sidecar matches from the root
            self.note_load(keys[: (skip + found) * KEY_BYTES], skip)
        return found

    def note_lookup(self, asked: int, hit: int) -> None:
        with self._lock:
            if self._empty():
                self._since = time.monotonic()
            self._lookups += (asked, hit)

    def note_load(self, keys: bytes, skip: int = 0) -> None:
        """A load of `keys` (a prefix's whole chain) past its first `skip` blocks."""
        with self._lock:
            if self._empty():
                self._since = time.monotonic()
            self._loads.append(keys)
            self._load_skip.append(skip)

    def note_seen(self, chain: bytes) -> None:
        """An observed lookup's whole key chain (from any thread)."""
        with self._lock:
            if self._empty():
                self._since = time.monotonic()
            self._seen.append(chain)

    def _empty(self) -> bool:
        return not self._lookups and not self._loads and not self._seen

    def due(self) -> bool:
        """Whether the batch should go now."""
        pending = len(self._lookups) // 2 + len(self._loads) + len(self._seen)
        return pending >= TOUCH_BATCH or (
            pending > 0 and time.monotonic() - self._since >= TOUCH_SECONDS
        )

    def add_granted(self, slots: list[int]) -> None:
        """Slots granted to this rank, for its saves."""
        with self._lock:
            self.granted += slots

    def take_granted(self, n: int) -> tuple[np.ndarray, int] | None:
        """`n` granted slots, taken for a save, and the epoch they belong to
        (None: fewer are held); a save that took some ends with `committed`
        or `give_back`."""
        with self._lock:
            if len(self.granted) < n:
                return None
            self.last_taken = time.monotonic()
            slots = np.array(self.granted[len(self.granted) - n :], dtype=np.int64)
            del self.granted[len(self.granted) - n :]
            if n:
                self.in_flight += 1
            return slots, self.epoch

    def committed(self, slots: np.ndarray, epoch: int) -> None:
        """A save's commit was sent: its slots are the sidecar's again."""
        if slots.size:
            with self._lock:
                if epoch == self.epoch:
                    self.in_flight -= 1

    def give_back(self, slots: np.ndarray, epoch: int) -> None:
        """A save failed before its commit: its slots are still this rank's,
        unless the sidecar has taken the grant back since (`clear_granted`)."""
        if slots.size:
            with self._lock:
                if epoch == self.epoch:
                    self.granted += slots.tolist()
                    self.in_flight -= 1

    def clear_granted(self) -> None:
        """The sidecar forgot the session: every slot granted, taken or not,
        is not this rank's any more."""
        with self._lock:
            self.granted.clear()
            self.grant_request = None
            self.in_flight = 0
            self.epoch += 1

    def granted_reply(self, request: int, slots: list[int]) -> None:
        """The answer to Grant `request`: its slots join the grant, unless
        the grant was given back meanwhile (`take_idle_grant`)."""
        with self._lock:
            if self.grant_request == request:
                self.granted += slots
                self.grant_request = None

    def asked_grant(self, request: int) -> None:
        with self._lock:
            self.grant_request = request

    def take_idle_grant(self, idle_seconds: float) -> tuple[bool, int | None]:
        """Give the whole grant up when no save took a slot for
        `idle_seconds` and none is copying into one: (whether it was given
        up, the id of the Grant whose answer is unread then, abandoned)."""
        with self._lock:
            holds = bool(self.granted) or self.grant_request is not None
            idle = time.monotonic() - self.last_taken >= idle_seconds
            if not holds or not idle or self.in_flight:
                return False, None
            abandoned, self.grant_request = self.grant_request, None
            self.granted = []
            self.last_taken = time.monotonic()
        return True, abandoned

    def take_touch(self, session: str) -> tuple[Any, list[bytes]] | None:
        """The batch as a Touch request and its frames (None: nothing to
        send); the batch starts again empty."""
        with self._lock:
            if self._empty():
                return None
            lookups, loads, seen = self._lookups, self._loads, self._seen
            skips = self._load_skip
            self._lookups, self._loads, self._seen, self._load_skip = [], [], [], []
        request = p.Touch(
            v=p.PROTOCOL_VERSION,
            id=0,
            session=session,
            load_blocks=[len(k) // KEY_BYTES for k in loads],
            seen_blocks=[len(k) // KEY_BYTES for k in seen],
            load_skip=skips if any(skips) else [],
        )
        frames = [np.asarray(lookups, dtype=p.ID_DTYPE).tobytes(), b"".join(loads), b"".join(seen)]
        return request, frames

    def close(self) -> None:
        self.tails.stop()
        self.view.close()


_AS_IS = frozenset(np.dtype(t) for t in (np.int64, np.int32, np.uint64, np.uint32))
"""Token id dtypes whose slices the C key chain hashes in place (and range-checks
as it goes: ids past a lookup's first miss are not looked at)."""


def token_array(token_ids: Any) -> np.ndarray:
    """Token ids as a numpy array whose slices hash without a copy."""
    if isinstance(token_ids, torch.Tensor):
        token_ids = token_ids.detach().cpu().numpy()
    if (
        type(token_ids) is np.ndarray
        and token_ids.ndim == 1
        and token_ids.dtype in _AS_IS
        and token_ids.flags.c_contiguous
    ):
        return token_ids
    return canonical_tokens(token_ids)


Handle = Callable[[int, "int | None", "Callable[[Any], int] | None"], TransferHandle]
"""(tokens, the id of the reply to wait for or None, tokens as that reply
says or None) -> a handle with no plan."""


class HotLane:
    """A `KVClient`'s use of the hot index of the sidecar whose pool it has
    mapped (`index`; None: none): lookups, CPU-hit loads, saves into slots
    granted ahead (whole or layer by layer) and the Touch batch of what was
    done. Each method that may be refused returns None: the client then asks
    the sidecar. The client says when the index may be used (`flags`)."""

    def __init__(
        self,
        channel: Channel,
        session: str,
        *,
        lease: Callable[[], float],
        handle: Handle,
    ) -> None:
        self.index: HotPath | None = None
        self._channel = channel
        self._session = session
        self._lease = lease
        self._handle = handle
        self.heard_at = time.monotonic()
        """When a call or beat was last answered: the lease runs from there."""
        self.grants_lost = False
        """Set by the heartbeat's thread when the sidecar forgot the session."""

    def map(self, name: str, boot_id: str) -> None:
        """Use the hot index `name` (a Register reply's; "": none) of the
        sidecar of `boot_id` from now on."""
        if self.index is not None and (self.index.name, self.index.boot_id) != (name, boot_id):
            self.close()
        if self.index is None and name and hotindex.AVAILABLE:
            with contextlib.suppress(OSError, ShmPoolError, ValueError):  # then: no hot path
                self.index = HotPath(name)
                self.index.boot_id = boot_id

    def close(self) -> None:
        if self.index is not None:
            self.index.close()
            self.index = None

    def heard(self) -> None:  # the sidecar answered a call or a beat
        self.heard_at = time.monotonic()

    def flags(self, max_age: float) -> int:
        """The index's flags (0: none mapped, or not stamped within `max_age`
        seconds). Late
        replies to calls given up on are read first (their plans are given back)."""
        if self.index is None:
            return 0
        if self._channel.late:
            self._channel.drain()
        return self.index.flags(max_age)

    def take_touch(self) -> tuple[Any, list[bytes]] | None:
        """What was done through the hot index since the last Touch, as one
        (the heartbeat's thread sends it too, so none waits long)."""
        index = self.index
        return None if index is None else index.take_touch(self._session)

    def take_release(self) -> tuple[Any, list[bytes]] | None:
        """A Release of this rank's whole grant, once no save has taken a
        granted slot for GRANT_IDLE_SECONDS and none is copying into one
        (None: nothing to give back). Sent by the heartbeat's thread:
        granted slots are CPU space no other geometry may take (an extent
        holding one never changes hands), so an idle model must not keep
        them. A Grant whose answer is unread is given up with it."""
        index = self.index
        if index is None or self.grants_lost:
            return None
        released, abandoned = index.take_idle_grant(GRANT_IDLE_SECONDS)
        if not released:
            return None
        grant = -1 if abandoned is None else abandoned
        return self._req(p.Release, boot_id=index.boot_id, abandoned_grant=grant), []

    def send_touch(self) -> None:
        """Send what was done through the hot index (never awaited)."""
        touch = self.take_touch()
        if touch is not None:
            with contextlib.suppress(SidecarUnavailable):  # lost with the sidecar: harmless
                self._channel.send(*touch, reply=False)

    def lookup_tokens(self, hasher: KeyHasher, tokens: np.ndarray, flags: int) -> int | None:
        """Leading blocks of `tokens` in the CPU tier; None: ask (the rest may be below)."""
        assert self.index is not None
        observe = bool(flags & hotindex.OBSERVED)
        lower = bool(flags & hotindex.LOWER_TIERS)  # then a miss is asked, and observed there
        cpu, total = self.index.count(hasher, tokens, observe, tails=observe and not lower)
        if cpu < total and lower:
            return None
        return self._looked_up(total, cpu)

    def lookup_keys(self, keys: BlockKeys, flags: int) -> int | None:
        """`lookup_tokens` for precomputed keys."""
        assert self.index is not None
        kb = key_bytes(keys)
        cpu = self.index.view.count(kb)
        if cpu == len(keys) or not flags & hotindex.LOWER_TIERS:
            if flags & hotindex.OBSERVED and kb:
                self.index.note_seen(kb)
            return self._looked_up(len(keys), cpu)
        return None

    def _looked_up(self, asked: int, hit: int) -> int:
        assert self.index is not None
        if asked:
            self.index.note_lookup(asked, hit)
            if self.index.due():
                self.send_touch()
        return hit

    def load(
        self,
        copier: BlockCopier,
        layout: BlockLayout,
        keys: BlockKeys,
        blocks: np.ndarray,
        skip: int,
        max_age: float,
    ) -> int | None:
        """`HotPath.load`: the blocks loaded past `skip` (None: the sidecar must plan it)."""
        index = self.index
        assert index is not None
        lower = bool(index.flags(max_age) & hotindex.LOWER_TIERS)
        found = index.load(copier, layout, key_bytes(keys), blocks, skip, lower)
        if found is not None and index.due():
            self.send_touch()
        return found

    def grants_usable(self, index: HotPath) -> bool:
        """Read a Grant's answer if it came, ask for more slots when few are
        left; whether the slots held may be written: the session's lease was
        renewed within half a lease, and the sidecar has not forgotten the
        session since they were granted (else they are dropped here: the
        sidecar freed them, or holds them for a while as an orphan's)."""
        heard_at = self.heard_at  # first: the heartbeat sets grants_lost, then heard_at
        if self.grants_lost:
            self.grants_lost = False
            index.clear_granted()
            index.grant_low = GRANT_LOW
        if time.monotonic() - heard_at > self._lease() / 2:
            return False
        request = index.grant_request
        if request is not None:
            try:
                answer = self._channel.poll_reply(request)
            except (SidecarError, SidecarUnavailable):
                answer = None
                index.granted_reply(request, [])
            if answer is not None:
                got = np.frombuffer(answer[1][0], dtype=p.ID_DTYPE).tolist()
                index.granted_reply(request, got)
                # Fewer than asked: the rank holds its share of a small tier,
                # or the tier had few slots free. Asking again below GRANT_LOW
                # would send a Grant with every save in a tier whose share is
                # under it; a rank left with none asks with every save still.
                short = len(got) < GRANT_WANT
                index.grant_low = max(1, len(index.granted) // 2) if short else GRANT_LOW
        if index.grant_request is None and len(index.granted) < index.grant_low:
            with contextlib.suppress(SidecarUnavailable):
                index.asked_grant(self._channel.send(self._req(p.Grant, want=GRANT_WANT)))
        return True

    def _take_slots(
        self, keys: BlockKeys, layout: BlockLayout
    ) -> tuple[HotPath, bytes, int, np.ndarray, int] | None:
        """(the index, key bytes, blocks the CPU tier holds already, granted
        slots taken for the rest, their epoch); None when the protocol must save: TP, too
        few slots granted (more are asked for), or a lease that may be running out."""
        index = self.index
        assert index is not None
        if layout.tp_size != 1 or not self.grants_usable(index):
            return None
        kb = key_bytes(keys)
        first = index.view.count(kb)
        rest = len(keys) - first
        taken = index.take_granted(rest)
        if taken is None:
            return None
        return index, kb, first, *taken

    def _commit(
        self,
        index: HotPath,
        kb: bytes,
        first: int,
        slots: np.ndarray,
        epoch: int,
        num_tokens: int,
    ) -> TransferHandle:
        """Commit the blocks past `first` in one message, not awaited. Not
        sent when the sidecar that granted the slots is gone (another's
        index is mapped now): the bytes went to its segments, nothing is
        cached."""
        if index is not self.index:
            return self._handle(0, None, None)
        if not slots.size:
            return self._handle(num_tokens, None, None)
        try:
            request = self._req(p.Commit, first=first, boot_id=index.boot_id)
            ack = self._channel.send(request, [kb, p.ids_frame(slots)])
        except Exception:
            # Not sent: the slots are still this session's grant (over tcp, a
            # dropped connection comes back to the same sidecar, which still
            # holds them for us). A restarted sidecar's new grant replaces this index.
            index.give_back(slots, epoch)
            raise
        index.committed(slots, epoch)
        self.grants_usable(index)  # ask for more, if few are left
        tpb = num_tokens // (len(kb) // KEY_BYTES)
        # What the sidecar kept: a quota, or an eviction since the count, may drop blocks.
        return self._handle(num_tokens, ack, lambda reply: min(num_tokens, reply.cached * tpb))

    def save(
        self,
        copier: BlockCopier,
        layout: BlockLayout,
        keys: BlockKeys,
        blocks: np.ndarray,
        num_tokens: int,
    ) -> TransferHandle | None:
        """Copy the blocks the CPU tier lacks into slots granted ahead, then
        commit them in one message, not awaited (`wait()` waits for its
        answer, so that every engine's lookup sees the blocks after it).
        None where `_take_slots` is."""
        taken = self._take_slots(keys, layout)
        if taken is None:
            return None
        index, kb, first, slots, epoch = taken
        if slots.size:
            try:
                copier.save(blocks[first:], slots, layout, 0).synchronize()
            except Exception:
                index.give_back(slots, epoch)  # still ours: nothing was committed
                raise
        return self._commit(index, kb, first, slots, epoch, num_tokens)

    def layered_save(
        self,
        copier: CpuBlockCopier,
        layout: BlockLayout,
        keys: BlockKeys,
        blocks: np.ndarray,
        num_tokens: int,
    ) -> LayeredTransfer | None:
        """`save`, layer by layer: slots granted ahead taken now, the Commit
        sent by `finish()` (a failure gives the slots back)."""
        taken = self._take_slots(keys, layout)
        if taken is None:
            return None
        index, kb, first, slots, epoch = taken
        planes = copier.copied_planes
        return LayeredTransfer(
            None,
            num_tokens,
            planes.num_layers,
            planes.layer_splits,
            queue=(lambda part: [copier.save(blocks[first:], slots, layout, 0, layers=part)])
            if slots.size
            else None,
            finish=lambda copies: self._commit(index, kb, first, slots, epoch, num_tokens),
            fail=lambda err: index.give_back(slots, epoch),  # still ours: not committed
        )

    def _req(self, kind: type, **fields: Any) -> Any:
        return kind(v=p.PROTOCOL_VERSION, id=0, session=self._session, **fields)
