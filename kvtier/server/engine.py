"""The generation worker: admission, per-session ordering, and generation.

Requests for one session run one at a time, in arrival order (a FIFO lock per session). Up to
`max_concurrency` sessions generate at once. With `batching` on (the default) they all go to the
batch scheduler (`kvtier.server.batching`): one thread owns the model and every generating
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

from kvtier.errors import KvtierError, L1BudgetExceeded
from kvtier.server.backend import Backend
from kvtier.server.devicefault import DeviceFault, is_fatal_device_error
from kvtier.server.jobs import (
    Delta,
    Draining,
    Failed,
    Finished,
    Job,
    Overloaded,
    Started,
    Stream,
)
from kvtier.server.logitproc import Decoding, decoding_of, process, record
from kvtier.server.memplan import take_peak
from kvtier.server.model import ServedModel, cache_kwarg
from kvtier.server.reqmetrics import TurnClock
from kvtier.server.sampling import ReplyText, make_generator, sample
from kvtier.server.streaming import degrade
from kvtier.tiers.l3 import io as l3_io

if TYPE_CHECKING:  # pragma: no cover
    from kvtier.server.batching import BatchScheduler
    from kvtier.server.memplan import DeviceMemoryPlan

log = logging.getLogger("kvtier.server")


# The warm-up's session: '#' is outside what clients may send as a session id or tenant
# (kvtier.server.http._ID), so no client's session can ever be this one.
WARM_UP_SESSION = "#warm-up"
WARM_UP_TENANT = "#kvtier"
# Length of the warm-up prompt stored in L3 and restored from it (its chunks stay there).
WARM_UP_TOKENS = 1024
# Length of the warm-up prefill (measured, never stored): its first forward of prefill_step
# tokens is what the cost model times, at least its prefill_min_tokens (512). Longer than the
# stored prompt because attention sets up per length: on an H200 a 2,064-token prompt was
# recomputed in 125-230 ms by the first request after a start that warmed 1,024 tokens, and in
# 12 ms after one that warmed 2,048 (11-14 ms once warm).
WARM_UP_PREFILL_TOKENS = 2048
# New tokens after the restored prefix in the warm-up's returning turn (a short user message).
WARM_UP_SUFFIX = 32


def _isolate(config: Any, served: ServedModel) -> bool:
    device = getattr(served.model, "device", None)
    return bool(getattr(config, "isolate_cpus", False)) and getattr(device, "type", "") == "cuda"


class Engine:
    """Owns the model, the cache backend, the worker threads and the admission queue."""

    def __init__(
        self,
        served: ServedModel,
        backend: Backend,
        config: Any,
        metrics: Any = None,
        plan: DeviceMemoryPlan | None = None,
        on_fatal: Callable[[BaseException], None] | None = None,
    ):
        self.served = served
        self.backend = backend
        if hasattr(config, "for_device"):  # automatic settings (0) resolved for the device
            config = config.for_device(served.device.type)
        self.config = config
        self.metrics = metrics
        # the GPU memory plan (kvtier.server.memplan), None on the CPU; the warm-up records
        # what it measures into it (`measured`) and the start-up's peaks (`peaks`)
        self.plan = plan
        self.peaks: dict[str, int] = {}
        # A device fault that lost the device's CUDA context (kvtier.server.devicefault): no
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
        self.batching = bool(getattr(config, "batching", False))
        self._batch: BatchScheduler | None = None
        self._slots = asyncio.Semaphore(config.max_concurrency)
        # keyed by (tenant, session id): one tenant never waits on another's session
        self._session_locks: dict[tuple[str, str], tuple[asyncio.Lock, int]] = {}
        backend.on_forget(self.drop_pages)  # a session the cache forgets leaves the pages too
        self.waiting = 0
        self.running = 0
        self.draining = False
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

    def release(self, session_id: str, lock: asyncio.Lock, tenant: str) -> None:
        lock.release()
        self._unref((tenant, session_id))

    async def start(self, job: Job) -> Stream:
        """Admit a job and run it; returns once the prompt is restored (or raises)."""
        if self.draining:
            raise Draining("the server is shutting down; retry on another replica or later")
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
        from kvtier.server.batching import BatchScheduler

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
        across devices is left to its failover (kvtier.server.failover), which survives a lost
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

    async def drain(self) -> None:
        """Stop admitting, wait for running jobs, then hibernate every session (cache close)."""
        self.draining = True
        await self._idle.wait()
        if self._batch is not None:
            await asyncio.to_thread(self._batch.close)
        await asyncio.to_thread(self._pool.shutdown, True)
        await asyncio.to_thread(self.backend.close)

    def warm_up(
        self, tokens: int = WARM_UP_TOKENS, prefill_tokens: int = WARM_UP_PREFILL_TOKENS
    ) -> None:
        """Before the first request, run the paths it will take through the cache, so that it
        pays neither for their lazy set-up nor for the cost model's configured guesses.

        On a throwaway session under a tenant no client can name (WARM_UP_TENANT):
        1. prefill a prompt B twice, in `prefill_step` forwards like a request: the first pass
           (aborted, not measured) pays for kernels and buffers; the second is committed empty,
           so the cost model gets a measured prefill rate and no KV is kept;
        2. restore + commit a prompt A: its chunks go to L3 (found there again at the next
           start: the same tokens give the same keys, so no start adds to the store);
        3. hibernate, drop L2's copies, and restore A again: loaded from L3 (or recomputed,
           whichever the now measured cost model picks, as a request's restore would), which
           sets up the L3 read path and measures it, with new tokens after the prefix and one
           decode step, as a returning turn runs;
        4. hibernate, drop L2's copies and restore A from L3 once more, calibrating: this read,
           with the set-up paid, replaces the cost model's L3 estimate (the first one is bounded);
           then abort and close the session.
        An L1 too small for the session's K/V (L1BudgetExceeded) gets all four on shorter
        prompts, halved until they fit, rather than no warm-up.
        """
        self._peak("before_warm_up")
        room = self.served.context_tokens - 2
        n, n_b = max(2, min(tokens, room)), max(2, min(prefill_tokens, room))
        if self.served.devices is not None:
            # Layers across devices: the session Cache (L1) lives on the primary device, which
            # the plain forward's attention would read from every device; warm the batch only.
            vocab = self.served.vocab_size
            prefill = [(i * 7 + 3) % vocab for i in range(n_b)]
            self._warm_batch([(i * 5 + 11) % vocab for i in range(min(n, WARM_UP_SUFFIX))], prefill)
            return
        # ids the model embeds (an id past its embeddings is a device-side assert on CUDA)
        vocab = self.served.vocab_size
        device = self.served.device
        prompt_b = ((torch.arange(n_b + 1, device=device) * 7 + 3) % vocab).unsqueeze(0)
        prompt_a = ((torch.arange(n + 1, device=device) * 5 + 11) % vocab).unsqueeze(0)
        suffix = ((torch.arange(WARM_UP_SUFFIX, device=device) * 3 + 1) % vocab).unsqueeze(0)
        a, b = prompt_a, prompt_b
        while True:
            try:
                self._warm_cache(a, b, suffix)
                break
            except L1BudgetExceeded as exc:
                # A small L1: the session's K/V did not fit. Shorter prompts take the same
                # paths, so warm up at a length that fits rather than not at all: the prefill
                # prompt at the stored one's length first, then both halved.
                if b.shape[1] > a.shape[1]:
                    b = b[:, : a.shape[1]]
                elif a.shape[1] > 3:
                    a = a[:, : max(3, a.shape[1] // 2)]
                    b = b[:, : a.shape[1]]
                else:
                    raise
                log.info("warm-up: %s; again with a %d-token prompt", exc, b.shape[1])
        self._peak("warm_up_through_cache")
        # the batch's prompts live in its page pool, not in L1: the prefill at full length
        self._warm_batch(prompt_a[0, :WARM_UP_SUFFIX].tolist(), prompt_b[0].tolist())

    def _warm_cache(
        self, prompt_a: torch.Tensor, prompt_b: torch.Tensor, suffix: torch.Tensor
    ) -> None:
        """Steps 1-4 of `warm_up` through the cache, on the throwaway session (forgotten after,
        also when a step fails)."""
        sid, backend = WARM_UP_SESSION, self.backend
        try:
            self._warm_pass(prompt_b, commit=None)
            self._warm_pass(prompt_b, commit=prompt_b[0, :0])
            self._warm_pass(prompt_a, commit=prompt_a[0])
            backend.hibernate(sid, WARM_UP_TENANT)
            backend.evict_l2()
            # A returning turn: the stored prefix plus new tokens, prefilled over the restored
            # KV (a query of several tokens against a longer past, a kernel of its own), then a
            # decode step.
            self._warm_pass(torch.cat([prompt_a, suffix], dim=1), commit=None, decode=True)
            # Once more from L3, its set-up paid: this read replaces the cost model's L3 estimate
            # (the first read of a process is bounded, as it pays for lazy set-up).
            backend.hibernate(sid)
            backend.evict_l2()
            with backend.calibrating():
                self._warm_pass(torch.cat([prompt_a, suffix], dim=1), commit=None)
        finally:
            backend.forget(sid, WARM_UP_TENANT)

    def _warm_batch(self, prompt: list[int], prefill: list[int]) -> None:
        """Start the batch scheduler (its page pool is allocated now, not in the first request)
        and run its three kinds of step once on throwaway sequences: a prefill, a step mixing a
        prefill with a decode, and a decode-only step. Each attention path compiles or selects
        its kernels on first use (the Triton decode kernel is compiled then), which the first
        requests after a start would otherwise wait for."""
        sched = self._scheduler()
        if sched is None:
            return
        from kvtier.paged import PagedSequence, SeqInput

        a, b = PagedSequence(), PagedSequence()
        try:
            tok = int(sched.runner.step([SeqInput(a, prompt)])[0].argmax())
            if sched.runner.max_batch > 1:  # one slot (--max-concurrency 1): never two at once
                sched.runner.step([SeqInput(a, [tok]), SeqInput(b, prompt)])
            sched.runner.step([SeqInput(a, [tok]), SeqInput(b, [tok])][: sched.runner.max_batch])
        finally:
            sched.runner.release(a)
            sched.runner.release(b)
        # one graph cannot span devices: a model placed across several runs eager
        placed = self.served.devices is not None
        if self.config.cuda_graphs and sched.pool.device.type == "cuda" and not placed:
            started = time.perf_counter()
            device = sched.pool.device
            self._peak("batch_first_steps")
            before = torch.cuda.memory_reserved(device)
            sizes = sched.runner.capture_graphs(decode_graphs=self.config.decode_graphs)
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()  # the capture's eager passes cached blocks on a side stream
            # the graphs' one shared pool, measured (the plan measured a capture like it)
            graphs = torch.cuda.memory_reserved(device) - before
            self._peak("graph_capture")
            if self.plan is not None:
                self.plan = self.plan.with_measured(graphs=graphs)
            log.info(
                "batched step captured as CUDA graphs for %s new tokens in %.1f s (%.0f MiB)",
                ", ".join(map(str, sizes)) or "no",
                time.perf_counter() - started,
                graphs / 2**20,
            )
        self._time_batched_prefill(sched, prefill)
        self._peak("batched_prefill")

    def _peak(self, phase: str) -> None:
        """Record the device's peak bytes since the last phase as `phase`'s (with a plan)."""
        if self.plan is not None:
            self.peaks[phase] = take_peak(self.served.device)

    def _time_batched_prefill(self, sched: Any, prompt: list[int]) -> None:
        """Prefill `prompt` the way a recompute runs (in `prefill_step` chunks, each after the
        first attending over the pages before it, then its first decode step), twice, after the
        graphs are captured; give the cost model the second one's rate. The first pays every
        first use on the paths a long prompt takes (a chunk over earlier pages, a short last
        chunk, each graph's first launch): on a GPU the first request after a start paid
        13-17 ms of these before this ran whole prompts here. The warm-up's other prefills ran
        through the session's Cache, a slower path than the batch's."""
        from kvtier.paged import PagedSequence, SeqInput

        pool = sched.pool
        prompt = prompt[: max(0, (pool.num_free - 2) * pool.page_size)]  # a small pool
        if len(prompt) < 2:
            return
        step = max(1, int(self.config.prefill_step))
        seconds = 0.0
        for _ in range(2):
            seq = PagedSequence()
            try:
                t0 = time.perf_counter()
                for start in range(0, len(prompt), step):
                    logits = sched.runner.step([SeqInput(seq, prompt[start : start + step])])
                tok = int(logits[0].argmax())
                seconds = time.perf_counter() - t0
                sched.runner.step([SeqInput(seq, [tok])])
            finally:
                sched.runner.release(seq)
        with self.backend.calibrating():
            self.backend.observe_prefill(len(prompt), seconds)

    def _warm_pass(
        self, ids: torch.Tensor, commit: torch.Tensor | None, decode: bool = False
    ) -> None:
        """Restore `ids` on the warm-up session and prefill the rest as `_generate` does (and
        one decode step with `decode`); then commit `commit` (which may be empty) or, with
        None, abort."""
        sid, tenant = WARM_UP_SESSION, WARM_UP_TENANT
        restored = self.backend.restore(sid, tenant, ids)
        try:
            pos, total = restored.covered, ids.shape[1]
            logits = None
            while pos < total:
                end = min(total, pos + self.config.prefill_step)
                logits = self._forward(ids[:, pos:end], restored.kv)
                pos = end
            if decode and logits is not None:
                token = torch.argmax(logits).reshape(1, 1).to(ids.device)
                self._forward(token, restored.kv)
        except BaseException:
            self.backend.abort(sid, tenant)
            raise
        if commit is None:
            self.backend.abort(sid, tenant)
        else:
            self.backend.commit(sid, tenant, commit)

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
            backend.abort(job.session_id, job.tenant)  # forget the half-written step
            if job.ephemeral:
                backend.forget(job.session_id, job.tenant)
            raise
        # Commit what the KV now covers, also after a disconnect: a returning client finds it.
        backend.commit(job.session_id, job.tenant, fed)
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
        reply = ReplyText(self.served.tokenizer, self.served.eos_ids, job.stop)
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
