"""The generation worker: admission, per-session ordering, and generation.

Requests for one session run one at a time, in arrival order (a FIFO lock per session). Up to
`max_concurrency` sessions generate at once. With `batching` on (the default) they all go to the
batch scheduler (`kvtier.server.batch.batching`): one thread owns the model and every generating
session adds its next token (or a prompt chunk) to one forward per step. With it off, each runs
on a worker thread and every model forward takes one lock, so concurrent sessions interleave
token by token. A request that finds no slot waits at most `queue_timeout` seconds, and is
refused with 429 + Retry-After when the wait would be longer or `max_queue` requests are
already waiting.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from kvtier.errors import KvtierError
from kvtier.server.backend import Backend
from kvtier.server.batch.jobs import (
    Delta,
    Draining,
    Failed,
    Finished,
    Job,
    Overloaded,
    Started,
    Stream,
)
from kvtier.server.batch.warmup import WARM_UP_PREFILL_TOKENS, WARM_UP_TOKENS, WarmUp
from kvtier.server.config import ServerConfig
from kvtier.server.decoding.logitproc import Decoding, decoding_of, process, record
from kvtier.server.decoding.sampling import ReplyText, make_generator, sample
from kvtier.server.devices.devicefault import DeviceFault, is_fatal_device_error
from kvtier.server.devices.model import ServedModel, cache_kwarg
from kvtier.server.devices.streaming import degrade
from kvtier.server.reqmetrics import TurnClock
from kvtier.tiers.l3 import io as l3_io

if TYPE_CHECKING:  # pragma: no cover
    from kvtier.server.batch.batching import BatchScheduler
    from kvtier.server.devices.memplan import DeviceMemoryPlan

log = logging.getLogger("kvtier.server")


def _isolate(config: ServerConfig, served: ServedModel) -> bool:
    device = getattr(served.model, "device", None)
    return config.isolate_cpus and getattr(device, "type", "") == "cuda"


class Engine:
    """Owns the model, the cache backend, the worker threads and the admission queue."""

    def __init__(
        self,
        served: ServedModel,
        backend: Backend,
        config: ServerConfig,
        metrics: Any = None,
        plan: DeviceMemoryPlan | None = None,
        on_fatal: Callable[[BaseException], None] | None = None,
    ):
        self.served = served
        self.backend = backend
        config = config.for_device(served.device.type)  # automatic settings (0) resolved
        self.config = config
        self.metrics = metrics
        # the GPU memory plan (kvtier.server.devices.memplan), None on the CPU; the warm-up records
        # what it measures into it (`measured`) and the start-up's peaks (`peaks`)
        self.plan = plan
        self.peaks: dict[str, int] = {}
        # A device fault that lost the device's CUDA context (kvtier.server.devices.devicefault): no
        # request can succeed after it. `on_fatal` (the app's: stop, exit non-zero) is told once.
        self.fatal: DeviceFault | None = None
        self.on_fatal = on_fatal
        self._fatal_lock = threading.Lock()
        self.model_lock = threading.Lock()
        self._kwarg = cache_kwarg(served.model)
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=config.max_concurrency,
            thread_name_prefix="kvtier-gen",
            # On a GPU, generation threads share one core (they take turns on the model lock
            # and only launch kernels); L3 disk threads started afterwards keep off it
            # (docs/benchmarks.md, "interference"). Never on the CPU: the model's own thread
            # pool would inherit that one core.
            initializer=l3_io.isolate_caller if _isolate(config, served) else None,
        )
        # The batch scheduler takes the model over (paged attention) at the first request, so
        # a warm-up before it still runs the model the plain way.
        self.batching = config.batching
        self._batch: BatchScheduler | None = None
        self._slots = asyncio.Semaphore(config.max_concurrency)
        # keyed by (tenant, session id): one tenant never waits on another's session
        self._session_locks: dict[tuple[str, str], tuple[asyncio.Lock, int]] = {}
        backend.on_forget(self.drop_pages)  # a session the cache forgets leaves the pages too
        self.waiting = 0
        self.running = 0
        self.draining = False
        # POST /admin/drain: /readyz answers 503 so the router sends no more, requests still
        # served until it stops; `admitted_at` tells when it did (kvtier.server.http.admin)
        self.leaving = False
        self.admitted_at = time.monotonic()
        self._drained = False
        self._idle = asyncio.Event()
        self._idle.set()

    # ---- admission ------------------------------------------------------------------------

    def _lock_for(self, key: tuple[str, str]) -> asyncio.Lock:
        lock, refs = self._session_locks.get(key, (None, 0))
        if lock is None:
            lock = asyncio.Lock()
        self._session_locks[key] = (lock, refs + 1)
        return lock

    def _unref(self, key: tuple[str, str]) -> None:
        lock, refs = self._session_locks[key]
        if refs <= 1:
            del self._session_locks[key]
        else:
            self._session_locks[key] = (lock, refs - 1)

    def _retry_after(self) -> int:
        return max(1, int(self.config.queue_timeout / 4) or 1)

    async def session_exclusive(self, session_id: str, tenant: str) -> asyncio.Lock:
        """Take a session's lock (for admin operations); the caller releases it via release()."""
        key = (tenant, session_id)
        lock = self._lock_for(key)
        try:
            await asyncio.wait_for(lock.acquire(), self.config.queue_timeout)
        except (TimeoutError, asyncio.TimeoutError):
            self._unref(key)
            raise Overloaded(
                f"session {session_id!r} is busy; retry later", self._retry_after()
            ) from None
        return lock

    def busy(self, session_id: str, tenant: str) -> bool:
        """Whether a request of this session is queued or running here (or an admin holds it):
        its next one must come here too, behind it (kvtier.server.batch.replicas)."""
        return (tenant, session_id) in self._session_locks

    def release(self, session_id: str, lock: asyncio.Lock, tenant: str) -> None:
        lock.release()
        self._unref((tenant, session_id))

    async def start(self, job: Job) -> Stream:
        """Admit a job and run it; returns once the prompt is restored (or raises)."""
        if self.draining:
            raise Draining("the server is shutting down; retry on another replica or later")
        self.admitted_at = time.monotonic()
        if self.fatal is not None:  # the process is on its way out: its supervisor restarts it
            raise Draining(f"{self.fatal}; retry on another replica or later")
        job, streaming = degrade(job, self.served.devices, self.config)
        if self.waiting >= self.config.max_queue:
            self._count("rejected")
            raise Overloaded(
                f"the queue is full ({self.waiting} waiting, max_queue); retry later",
                self._retry_after(),
            )
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.queue_timeout
        key = (job.tenant, job.session_id)
        lock = self._lock_for(key)
        self.waiting += 1
        self._gauge()
        try:
            try:
                await asyncio.wait_for(lock.acquire(), max(0.0, deadline - loop.time()))
            except (TimeoutError, asyncio.TimeoutError):
                self._unref(key)
                self._count("rejected")
                raise Overloaded(
                    f"session {job.session_id!r} still has a request running after "
                    f"{self.config.queue_timeout:g}s; retry later",
                    self._retry_after(),
                ) from None
            try:
                await asyncio.wait_for(self._slots.acquire(), max(0.0, deadline - loop.time()))
            except (TimeoutError, asyncio.TimeoutError):
                self.release(job.session_id, lock, job.tenant)
                self._count("rejected")
                raise Overloaded(
                    f"all {self.config.max_concurrency} generation slots stayed busy for "
                    f"{self.config.queue_timeout:g}s; retry later",
                    self._retry_after(),
                ) from None
            except BaseException:
                self.release(job.session_id, lock, job.tenant)
                raise
        finally:
            self.waiting -= 1
        self.running += 1
        self._idle.clear()
        self._gauge()
        clock = TurnClock.start(self.metrics, job.internal)  # from the HTTP request's arrival
        stream = Stream(loop, streaming=streaming, clock=clock)
        admitted = time.perf_counter()
        batch = self._scheduler()

        def done(_: Any = None) -> None:  # the job ended: free its slot and session lock
            self._slots.release()
            self.release(job.session_id, lock, job.tenant)
            self.running -= 1
            if self.running == 0:
                self._idle.set()
            self._gauge()
            stream.clock.ended()  # its latencies (kvtier.server.reqmetrics)

        if batch is not None:
            try:
                future = asyncio.wrap_future(batch.submit(job, stream, admitted))
            except BaseException:
                done()
                raise
        else:
            future = loop.run_in_executor(self._pool, self._run, job, stream, admitted)
        future.add_done_callback(done)
        first = await stream.queue.get()
        if isinstance(first, Failed):
            raise first.error
        stream.started = first
        return stream

    def _scheduler(self) -> BatchScheduler | None:
        """The batch scheduler, started at the first request; None with batching off, or where
        the model cannot run paged (then requests run one thread each, as with it off)."""
        if not self.batching or self._batch is not None:
            return self._batch
        from kvtier.server.batch.batching import BatchScheduler

        try:
            self._batch = BatchScheduler(
                self.served, self.backend, self.config, self.metrics, on_error=self.device_fault
            )
        except KvtierError as exc:
            if self.served.devices is not None:
                raise  # a model across devices runs only through the batch
            log.warning("batching is off for this model (%s); one thread per request", exc)
            self.batching = False
        return self._batch

    def device_fault(self, exc: BaseException) -> bool:
        """Whether `exc` is a device fault that lost the CUDA context (`is_fatal_device_error`):
        then the engine is failed for good and `on_fatal` hears of it, once. A model placed
        across devices is left to its failover (kvtier.server.devices.failover), which survives a lost
        device."""
        if self.served.devices is not None or not is_fatal_device_error(exc):
            return False
        with self._fatal_lock:
            if self.fatal is not None:
                return True
            self.fatal = DeviceFault.of(exc)
        log.critical("%s", self.fatal)
        if self.on_fatal is not None:
            self.on_fatal(self.fatal)
        return True

    def drop_pages(self, session_id: str, tenant: str) -> None:
        """The session's parked K/V pages, if the batch holds any, are freed (an admin's
        hibernate or forget: with paged L1 they are the session's L1)."""
        if self._batch is not None:
            self._batch.drop_parked(session_id, tenant)

    # ---- what the admin routes ask of the sessions (kvtier.server.http.admin) ------------------------

    async def tenants_of(self, session_id: str) -> list[str]:
        """The tenants that have a session of this id (in memory or stored)."""
        return await asyncio.to_thread(self.backend.tenants_of, session_id)

    async def session_admin(self, session_id: str, tenants: list[str], op: str) -> bool:
        """`op` ("hibernate", "prefetch" or "forget") on each tenant's session of this id, each
        under its session's lock (after the requests queued on it); whether any was found.
        Raises `Overloaded` when a session's queue is full."""
        if op not in ("hibernate", "prefetch", "forget"):
            raise ValueError(f"unknown session operation {op!r}")
        fn = getattr(self.backend, op)
        found = False
        for name in tenants:
            lock = await self.session_exclusive(session_id, name)
            try:
                found |= bool(await asyncio.to_thread(fn, session_id, name))
                if op in ("hibernate", "forget"):
                    self.drop_pages(session_id, name)  # paged L1: its pages are its L1
            finally:
                self.release(session_id, lock, name)
        return found

    async def shred_tenant(self, tenant: str) -> dict[str, Any]:
        """Crypto-shred a tenant (`TieredCache.shred_tenant`): what was deleted, by kind."""
        return await asyncio.to_thread(self.backend.shred_tenant, tenant)

    @property
    def devices(self) -> Any:
        """The model's device failover (`DeviceFailover`), or None on one device."""
        return self.served.devices

    async def drain(self, close_backend: bool = True) -> None:
        """Stop admitting, wait for running jobs, then hibernate every session (cache close;
        not with `close_backend` False: replicas share one cache, closed after the last)."""
        self.draining = True
        if self._drained:  # POST /admin/drain did, before the shutdown
            return
        self._drained = True
        await self._idle.wait()
        if self._batch is not None:
            await asyncio.to_thread(self._batch.close)
        await asyncio.to_thread(self._pool.shutdown, True)
        if close_backend:
            await asyncio.to_thread(self.backend.close)

    def warm_up(
        self, tokens: int = WARM_UP_TOKENS, prefill_tokens: int = WARM_UP_PREFILL_TOKENS
    ) -> None:
        """Before the first request, run the paths it will take through the cache and the batch
        (kvtier.server.batch.warmup); the GPU memory plan gets what the warm-up measured."""
        self.plan = WarmUp(
            served=self.served,
            backend=self.backend,
            config=self.config,
            plan=self.plan,
            peaks=self.peaks,
            forward=self._forward,
            scheduler=self._scheduler,
        ).run(tokens, prefill_tokens)

    # ---- the worker ---------------------------------------------------------------------------

    def _forward(self, ids: torch.Tensor, kv: Any) -> torch.Tensor:
        with self.model_lock, torch.inference_mode():
            out = self.served.model(
                input_ids=ids, use_cache=True, logits_to_keep=1, **{self._kwarg: kv}
            )
        return out.logits[0, -1].float()

    def _sample(
        self, logits: torch.Tensor, job: Job, gen: torch.Generator | None, d: Decoding | None
    ) -> int:
        if d is None:
            return sample(logits, job.temperature, job.top_p, gen, self.served.allowed)
        row = logits.unsqueeze(0).clone()
        process(row, [d])
        token = sample(row[0], job.temperature, job.top_p, gen, self.served.allowed)
        record(row, [d], [token])
        return token

    def _run(self, job: Job, stream: Stream, admitted: float) -> None:
        try:
            self._generate(job, stream, admitted)
        except BaseException as exc:  # surfaced to the client; the server keeps serving
            self.device_fault(exc)  # unless it lost the device: then it stops
            if isinstance(exc, KvtierError):
                log.warning("session %s: %s: %s", job.session_id[:64], type(exc).__name__, exc)
            else:
                log.exception("generation failed for session %s", job.session_id[:64])
            stream.put(Failed(exc))

    def _generate(self, job: Job, stream: Stream, admitted: float) -> None:
        served, backend = self.served, self.backend
        ids = torch.tensor([job.prompt_ids], dtype=torch.long, device=served.device)
        total = ids.shape[1]
        stream.clock.admit(admitted)  # a worker thread runs it: not queued behind others
        restored = backend.restore(job.session_id, job.tenant, ids)
        kv, pos = restored.kv, restored.covered
        fed = list(job.prompt_ids[:pos])
        stream.put(Started(restored.source, pos, total))
        gen_ids: list[int] = []
        try:
            finished = "cancelled"
            logits = None
            while pos < total and not stream.cancelled.is_set():
                end = min(total, pos + self.config.prefill_step)
                logits = self._forward(ids[:, pos:end], kv)
                fed.extend(job.prompt_ids[pos:end])
                pos = end
            if logits is not None and not stream.cancelled.is_set():
                if not job.internal:
                    self._observe_ttft(restored.source, time.perf_counter() - admitted)
                finished = self._decode(job, stream, kv, logits, fed, gen_ids)
        except BaseException:
            # forget the half-written step
            backend.abort(job.session_id, job.tenant, session=restored.session)
            if job.ephemeral:
                backend.forget(job.session_id, job.tenant)
            raise
        # Commit what the KV now covers, also after a disconnect: a returning client finds it.
        backend.commit(job.session_id, job.tenant, fed, session=restored.session)
        if job.ephemeral:
            backend.forget(job.session_id, job.tenant)
        elif finished == "cancelled":
            backend.hibernate(job.session_id, job.tenant)  # the client went away: free its L1
        if not job.internal:
            self._count("completion_tokens", len(gen_ids))
            self._count("prompt_tokens", total)
        stream.put(Finished(finished, total, len(gen_ids), restored.covered, restored.source))

    def _decode(
        self,
        job: Job,
        stream: Stream,
        kv: Any,
        logits: torch.Tensor,
        fed: list[int],
        gen_ids: list[int],
    ) -> str:
        reply = ReplyText(self.served.tokenizer, self.served.eos_ids, job.stop, job.ignore_eos)
        gen = make_generator(job.temperature, job.seed)
        device = self.served.device
        d = decoding_of(job)
        for step in range(job.max_tokens):
            token = self._sample(logits, job, gen, d)
            gen_ids.append(token)
            stream.clock.token(time.perf_counter())
            delta = reply.add(token)
            if d is not None and d.logprobs is not None:
                stream.put(Delta(delta, d.take_pending()))
            elif delta:
                stream.put(Delta(delta))
            if reply.stopped:
                return "stop"
            if reply.eos or step == job.max_tokens - 1 or stream.cancelled.is_set():
                break
            logits = self._forward(torch.tensor([[token]], device=device), kv)
            fed.append(token)
        if stream.cancelled.is_set():
            return "cancelled"
        rest = reply.rest()
        if rest:
            stream.put(Delta(rest))
        return "stop" if reply.eos else "length"

    # ---- metrics (optional) ---------------------------------------------------------------

    def _count(self, name: str, n: int = 1) -> None:
        if self.metrics is not None:
            self.metrics.count(name, n)

    def _observe_ttft(self, source: str, seconds: float) -> None:
        if self.metrics is not None:
            self.metrics.ttft(source, seconds)

    def _gauge(self) -> None:
        if self.metrics is not None:
            self.metrics.load(self.running, self.waiting)
