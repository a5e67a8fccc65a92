"""The L3 writer process: write-through's disk work, out of the serving process.

A decode loop is one Python thread issuing thousands of small kernels per step. Writer threads
in the same interpreter, however little Python they run between their system calls, take the
interpreter lock back dozens of times per 14.7 MB chunk, and every time the decode thread must
give it up; on the GPU host that slowed decode steps 1.7 x while write-through ran, against
1.07 x with the same writes in another process (docs/benchmarks.md, "Write-through
interference").

So the L2 arena is shared memory (memfd slabs, `HostArena(shared=True)`) and a child process
maps the same slabs. For each chunk the serving process sends (slab, offset, length, header,
temp path); the child writes the .kvbin temp file straight from the slot (O_DIRECT when it
can), computes the checksum, fdatasyncs, and answers with the header as written. The rename,
the directory fsync and the index commit stay in the serving process's store (`L3Store.put`
with `writer=`), which keeps the one-writer lock and the index. The child runs at nice 10 on
the CPUs `l3_io.isolate_caller` left for background work.

If the child dies, or leaves a write unanswered for `WRITE_TIMEOUT` seconds (it is then
killed), every write in flight fails with `StoreIOError`, later writes fail at once, and
nothing stored is lost (a put that failed left no file and no index row). A child whose
construction fails part-way is killed and reaped before the error is raised.

    python3 -m kvtier.tiers.l3.writer --rx FD --tx FD   # started by WriterProcess only
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import mmap
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from multiprocessing.connection import Connection
from typing import Any

from kvtier.errors import ConfigError, StoreIOError
from kvtier.kvbin import ChunkHeader
from kvtier.tiers.l3 import io as l3_io
from kvtier.tiers.l3.store import write_chunk_file

# A write is one chunk's file and one fdatasync; a child that has not answered one in two
# minutes is stuck (stopped, deadlocked, or hung in the kernel), not merely slow.
WRITE_TIMEOUT = 120.0
_POLL = 0.2  # seconds between checks that the child is still alive, while a write waits
_REAP_TIMEOUT = 10.0


class WriterProcess:
    """The serving process's handle on one writer child (see the module docstring).

    A write waits at most `timeout` seconds for the child's answer. A child that has exited
    is noticed within `_POLL` seconds even while its pipes stay open; one that does not
    answer in time is killed and reaped. Either way the write, and every later one, fails
    with `StoreIOError`.
    """

    def __init__(
        self, slabs: list[tuple[int, int]], threads: int = 4, timeout: float = WRITE_TIMEOUT
    ) -> None:
        if timeout <= 0:
            raise ConfigError(f"the L3 writer's timeout must be positive, got {timeout} s")
        self.timeout = float(timeout)
        to_child_r, to_child_w = os.pipe()
        from_child_r, from_child_w = os.pipe()
        fds = [fd for fd, _ in slabs]
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)  # find this kvtier
        cmd = [sys.executable, "-m", "kvtier.tiers.l3.writer"]
        cmd += ["--rx", str(to_child_r), "--tx", str(from_child_w)]
        try:
            self._proc = subprocess.Popen(
                cmd, pass_fds=[to_child_r, from_child_w, *fds], env=env, stdin=subprocess.DEVNULL
            )
        except BaseException:
            os.close(to_child_w)
            os.close(from_child_r)
            raise
        finally:
            os.close(to_child_r)
            os.close(from_child_w)
        tx: Connection | None = None
        rx: Connection | None = None
        try:
            self._tx = tx = Connection(to_child_w, readable=False)
            self._rx = rx = Connection(from_child_r, writable=False)
            background = l3_io.background_cpus()
            cpus = sorted(background) if background else None
            self._tx.send(("init", slabs, threads, cpus))
            self._send_lock = threading.Lock()
            self._pending: dict[int, Future[ChunkHeader]] = {}
            self._ids = itertools.count()
            self._lock = threading.Lock()
            self._dead: str | None = None
            self._receiver = threading.Thread(
                target=self._receive, name="kvtier-l3writer-rx", daemon=True
            )
            self._receiver.start()
        except BaseException:  # no child, no pipe outlives a failed construction
            for conn, fd in ((tx, to_child_w), (rx, from_child_r)):
                if conn is not None:
                    conn.close()
                else:
                    os.close(fd)
            self._proc.kill()
            self._proc.wait()
            raise

    @property
    def pid(self) -> int:
        return self._proc.pid

    def write(
        self,
        slab: int,
        offset: int,
        length: int,
        header: ChunkHeader,
        tmp: str,
        direct: bool,
        keep_page_cache: bool,
        seal: Any = None,
    ) -> ChunkHeader:
        """Have the child write the chunk at (slab, offset) to `tmp`; blocks until it has, the
        child is gone, or `timeout` seconds have passed (then the child is stopped). `seal`:
        the tenant's data key (kvtier.sealing.DataKey) in an encrypted store, sent over the
        private pipe with the request: the child encrypts the slot's bytes as it writes."""
        future: Future[ChunkHeader] = Future()
        with self._lock:
            if self._dead is not None:
                raise StoreIOError(f"the L3 writer process is gone ({self._dead})")
            rid = next(self._ids)
            self._pending[rid] = future
        try:
            with self._send_lock:
                self._tx.send(("write", rid, slab, offset, length, header, tmp, direct,
                               keep_page_cache, seal))  # fmt: skip
        except OSError as exc:
            self._fail(f"sending to it failed: {exc}")
        try:
            self._await(future)
            return future.result()
        except StoreIOError:
            if self._proc.poll() is not None:  # gone: nothing writes `tmp` any more
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
            raise

    def _await(self, future: Future[ChunkHeader]) -> None:
        """Wait until `future` is done; fail it (and every write) if the child has exited or
        has not answered within `timeout` seconds."""
        deadline = time.monotonic() + self.timeout
        while True:
            left = deadline - time.monotonic()
            wait([future], timeout=max(0.0, min(_POLL, left)))
            if future.done():
                return
            code = self._proc.poll()
            if code is not None:  # exited, though its pipe may still be open elsewhere
                self._fail(f"exit status {code}")
            elif left <= _POLL:
                self._stop(f"no answer to a write within {self.timeout:g} s; it was killed")

    def _stop(self, why: str) -> None:
        """Fail every write, then kill the child that stopped answering and reap it."""
        self._fail(why)  # first: the pipe's EOF after the kill would name another cause
        self._proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._proc.wait(_REAP_TIMEOUT)  # a child stuck in the kernel may take a while

    def _receive(self) -> None:
        l3_io.background_thread(False)  # off the serving thread's core (it may have made us)
        while True:
            try:
                rid, result, error = self._rx.recv()
            except (EOFError, OSError) as exc:
                code = self._proc.poll()
                self._fail(f"exit status {code}" if code is not None else f"pipe closed: {exc}")
                return
            with self._lock:
                future = self._pending.pop(rid, None)
            if future is None:
                continue
            if error is not None:  # (errno or None, message): OSError keeps ENOSPC etc. typed
                code, message = error
                future.set_exception(OSError(code, message) if code else StoreIOError(message))
            else:
                future.set_result(result)

    def _fail(self, why: str) -> None:
        with self._lock:
            if self._dead is None:
                self._dead = why
            pending, self._pending = self._pending, {}
        for future in pending.values():
            if not future.done():
                future.set_exception(StoreIOError(f"the L3 writer process is gone ({why})"))

    def close(self, timeout: float = 30.0) -> None:
        """Let the child finish what it was sent, then stop it. Safe to call twice."""
        with self._send_lock:
            if not self._tx.closed:
                self._tx.close()  # EOF: the child drains its queue and exits
        try:
            self._proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._receiver.join(timeout)
        self._rx.close()


# ---- the child ---------------------------------------------------------------------------------


def _serve(rx: Connection, tx: Connection) -> None:
    kind, slabs, threads, cpus = rx.recv()
    assert kind == "init"
    maps = [mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ) for fd, size in slabs]
    views = [memoryview(m) for m in maps]
    local = threading.local()
    send_lock = threading.Lock()

    def setup() -> None:
        l3_io.background_thread()
        if cpus:
            os.sched_setaffinity(0, cpus)

    def buffer(name: str, size: int) -> memoryview:
        buf = getattr(local, name, None)
        if buf is None or len(buf) < size:
            buf = l3_io.aligned_buffer(size)
            setattr(local, name, buf)
        return buf

    def job(msg: tuple[Any, ...]) -> None:
        _, rid, slab, offset, length, header, tmp, direct, keep, seal = msg
        try:
            view = views[slab][offset : offset + length]
            out = write_chunk_file(
                header, view, tmp, direct=direct, keep_page_cache=keep, buffer=buffer, seal=seal,
                pool=pieces,  # a sealed chunk's pieces: written while the next is sealed
            )  # fmt: skip
            reply: tuple[Any, ...] = (rid, out, None)
        except BaseException as exc:  # sent back to the caller, whose put fails with it
            reply = (rid, None, (getattr(exc, "errno", None), f"{type(exc).__name__}: {exc}"))
        with send_lock:
            tx.send(reply)

    setup()
    pieces = ThreadPoolExecutor(max(1, threads), initializer=setup)
    with pieces, ThreadPoolExecutor(max(1, threads), initializer=setup) as pool:
        while True:
            try:
                msg = rx.recv()
            except (EOFError, OSError):
                break
            pool.submit(job, msg)
    for v in views:
        v.release()
    for m in maps:
        m.close()


def main() -> None:
    ap = argparse.ArgumentParser(description="kvtier's L3 writer process (internal)")
    ap.add_argument("--rx", type=int, required=True, help="pipe to read requests from")
    ap.add_argument("--tx", type=int, required=True, help="pipe to write results to")
    args = ap.parse_args()
    _serve(Connection(args.rx, writable=False), Connection(args.tx, readable=False))


if __name__ == "__main__":
    main()
