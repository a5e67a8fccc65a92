"""The disk mover: every copy between the L2 slots and the L3 store.

See docs/architecture.md, "Movement and policy".

Two thread pools (writes, reads) call the L3 store, whose O_DIRECT I/O goes straight between
the pinned slots and the .kvbin files. With a `WriterProcess` the writes' file work runs in a
child process that maps the same (shared) L2 slabs (kvtier.tiers.l3.writer). The write queue
is bounded: when it is full, `write_l3` sheds the write (returns None and counts it) instead
of stalling decode. A job first waits for the device copy still using its slot, and records
itself for the device mover, in the `SlotOrder` the movers share (kvtier.transfer.slots). A
restore settles each slot's L3 read there just before that chunk's copy, so chunks already
read move to the GPU while later ones are still coming off the disk; a failed read raises
there and its bytes never reach L1.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from kvtier.errors import ConfigError
from kvtier.kvbin import ChunkHeader
from kvtier.tiers.l2 import HostArena
from kvtier.tiers.l3 import io as l3_io
from kvtier.tiers.l3.writer import WriterProcess
from kvtier.transfer.accounting import Accounts
from kvtier.transfer.slots import SlotOrder
from kvtier.transfer.staging import Handle


class DiskMover:
    """Moves chunks L2 <-> L3: thread pools, the optional writer process, a bounded queue."""

    def __init__(
        self,
        arena: HostArena,
        l3_store: Any | None,
        accounts: Accounts,
        order: SlotOrder,
        *,
        l3_write_queue: int = 64,
        l3_threads: int = 4,
        proc: WriterProcess | None = None,
    ) -> None:
        self.arena = arena
        self.store = l3_store
        self._accounts = accounts
        self._lock = accounts.lock  # the queue and failure counts are read with the totals
        self._order = order  # each slot's last L3 I/O, and the device mover's copy on it
        # L3 jobs queued or running, and failed, by kind ("write", "read")
        self._queued = {"write": 0, "read": 0}
        self._failed = {"write": 0, "read": 0}
        self._writes: set[Future[Any]] = set()
        self._shed = 0
        self._writer = ThreadPoolExecutor(
            max(1, l3_threads),
            thread_name_prefix="kvtier-l3w",
            initializer=l3_io.background_thread,  # below the decode loop's CPU priority
        )
        self._reader = ThreadPoolExecutor(
            max(1, l3_threads),
            thread_name_prefix="kvtier-l3r",
            initializer=l3_io.background_thread,
            initargs=(False,),  # a restore waits for reads: normal priority, off the serving core
        )
        self.l3_write_queue = int(l3_write_queue)
        self.proc = proc

    def counts(self) -> tuple[int, int, int, int, int]:
        """(writes queued, reads queued, writes shed, writes failed, reads failed); the
        caller holds the accounts' lock."""
        return (
            self._queued["write"],
            self._queued["read"],
            self._shed,
            self._failed["write"],
            self._failed["read"],
        )

    def write_l3(self, slot: int, header: Any) -> Future[Any] | None:
        """Queue the chunk in `slot` for a durable L3 write; None when shed (queue full)."""
        if self.store is None:
            raise ConfigError("this engine has no L3 store; pass l3_store to write to SSD")
        with self._lock:
            if self._queued["write"] >= self.l3_write_queue:
                self._shed += 1
                return None
            self._queued["write"] += 1
        copy = self._order.last_copy(slot)
        try:
            future = self._writer.submit(self._write, slot, header, copy)
        except BaseException:
            with self._lock:
                self._queued["write"] -= 1
            raise
        self._order.started_io(slot, future, False)
        with self._lock:
            self._writes.add(future)
        future.add_done_callback(self._write_done)
        return future

    def _write_done(self, future: Future[Any]) -> None:
        with self._lock:
            self._writes.discard(future)

    def _write(self, slot: int, header: Any, copy: Handle | None) -> Any:
        def put() -> Any:
            payload = self.arena.buffer(slot)[: header.payload_len]
            return self._need_store().put(header, payload, writer=self._temp_writer(slot))

        return self._l3_job("write", copy, put)

    def _l3_job(self, kind: str, copy: Handle | None, work: Any) -> Any:
        """Run one L3 write or read on a pool thread: wait for the device copy still using
        the slot, time the I/O, and keep the queue and failure counts of `kind`."""
        direction = ("l2", "l3") if kind == "write" else ("l3", "l2")
        try:
            if copy is not None:
                copy.wait()  # the slot's device copy finishes before the disk touches the slot
            t0 = time.perf_counter()
            header = work()
            self._account(direction, header.payload_len, time.perf_counter() - t0, 1)
            return header
        except BaseException:
            with self._lock:
                self._failed[kind] += 1
            raise
        finally:
            with self._lock:
                self._queued[kind] -= 1

    def _temp_writer(self, slot: int) -> Any:
        """For `L3Store.put`: the writer process writes the slot's bytes, or None (threads)."""
        proc = self.proc
        if proc is None:
            return None
        slab, offset = self.arena.locate(slot)

        def write(header: Any, tmp: str, direct: bool, keep: bool, seal: Any = None) -> Any:
            return proc.write(slab, offset, header.payload_len, header, tmp, direct, keep, seal)

        return write

    def read_l3(
        self, key: bytes, slot: int, fingerprint: bytes, expect: ChunkHeader | None = None
    ) -> Future[Any]:
        """Read chunk `key` from L3 into `slot` (O_DIRECT); the future yields its ChunkHeader.

        `expect`: the header of the chunk the caller asked for (its tokens, geometry, codec,
        payload length, tenant); a file whose header says anything else is corrupt. A
        checksum, header, fingerprint or I/O failure comes back as the future's exception (and
        from a restore of that slot): the caller treats it as a miss and recomputes; no byte
        of it reaches the GPU.
        """
        self._need_store()  # fail in the caller, not in the pool thread
        self._order.settle_io(slot)
        copy = self._order.last_copy(slot)
        with self._lock:
            self._queued["read"] += 1
        future = self._reader.submit(self._read, key, slot, fingerprint, copy, expect)
        self._order.started_io(slot, future, True)
        return future

    def _read(
        self,
        key: bytes,
        slot: int,
        fingerprint: bytes,
        copy: Handle | None,
        expect: ChunkHeader | None = None,
    ) -> Any:
        def get() -> Any:
            buf = self.arena.buffer(slot)
            return self._need_store().get(key, buf, fingerprint=fingerprint, expect=expect)

        return self._l3_job("read", copy, get)

    def _need_store(self) -> Any:
        if self.store is None:
            raise ConfigError("this engine has no L3 store; pass l3_store to use the SSD tier")
        return self.store

    def flush(self) -> None:
        """Wait until every queued L3 write has finished (successfully or not)."""
        with self._lock:
            pending = list(self._writes)
        for future in pending:
            future.exception()

    def _account(self, direction: tuple[str, str], nbytes: int, seconds: float, ops: int) -> None:
        self._accounts.account(direction, nbytes, seconds, ops)

    def close(self) -> None:
        """Finish queued L3 writes and reads (never drop stored data), then stop."""
        self._writer.shutdown(wait=True)
        self._reader.shutdown(wait=True)
        if self.proc is not None:
            self.proc.close()
