"""The batching scheduler: every decoding session adds one token to ONE forward per iteration.

One thread owns the model. A submitted job is restored on a small thread pool (the tiered cache
hands back a transformers Cache over the first `covered` prompt tokens) and only then queued as
*waiting*; each iteration the scheduler thread

1. finishes sequences whose client went away;
2. takes one token from every *running* sequence that decodes (a page more where its last page
   is full; when the pool has no free page, the latest admitted sequence is preempted: its K/V is
   appended to its session's Cache and its pages freed, and it waits at the head of the queue);
3. admits waiting sequences while budget (what the prompts that finish in one chunk leave of
   it), batch slots (`max_concurrency`), pages for their whole known token list and, while the
   step decodes, `admissions_per_step` (when set) remain: it copies the restored prefix's K/V
   into the new pages (device to device; with paged L1 a loader thread copies it from its L2
   slots, and the turn joins the steps once those copies are done).
   Full pages of that prefix that a running sequence of the same tenant already holds (same
   tokens from position 0) are shared instead of copied (`kvtier.server.pages.pageshare`);
4. fills the rest of the token budget (`batch_tokens`, or `decoding_prompt_tokens` when the
   step decodes) with prompt chunks (at most `prefill_step` tokens each) of the sequences still
   prefilling, those the budget takes whole first, oldest first (or shortest first:
   `prompt_order`; see `kvtier.server.batch.promptorder`), so a returning turn's first token does not wait
   behind a new conversation's long prefill;
5. runs the batch as one flattened forward (`kvtier.paged.BatchRunner`) and samples one token
   for every sequence whose tokens are all fed. When they are all greedy, the tokens stay on
   the device for the next step, which is launched before the host reads them
   (`kvtier.server.batch.lookahead`: the GPU does not wait on this thread). The step itself and its
   sampling are in `kvtier.server.batch.stepping`, which returns what it gave each turn;
6. ends the turns the step ended (`_ended`): their text streamed, their pages parked or freed,
   their commits started.

A finished turn's new K/V is stored off this thread (`kvtier.server.batch.committing`); its pages
stay parked as the session's L1 (`kvtier.server.pages.parking`). Restores never stall the batch.
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import sys
import threading
from array import array
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvtier.paged import BatchRunner, PagePool
from kvtier.server.backend import Backend, PagedBackend, RecomputeBackend
from kvtier.server.batch.committing import TurnCommits, report_failure
from kvtier.server.batch.counters import Counters
from kvtier.server.batch.eventpost import EventPost
from kvtier.server.batch.jobs import Delta, Job, Stream
from kvtier.server.batch.promptorder import PromptOrder
from kvtier.server.batch.restoring import RestoreWorkers, helper_threads
from kvtier.server.batch.schedthread import tune_interpreter
from kvtier.server.batch.scheduler import Item, RunQueues, Schedule, TurnScheduler
from kvtier.server.batch.stepping import StepOutput, StepRunner
from kvtier.server.batch.turn import Turn
from kvtier.server.decoding.logitproc import decoding_of
from kvtier.server.decoding.sampling import ReplyText, make_generator
from kvtier.server.devices.failover import make_pool
from kvtier.server.devices.memplan import decode_graphs, model_kv, page_size, pool_bytes
from kvtier.server.devices.model import ServedModel
from kvtier.server.pages import Key, Pages
from kvtier.tiers.l3 import io as l3_io

if TYPE_CHECKING:  # pragma: no cover
    from kvtier.server.config import ServerConfig

log = logging.getLogger("kvtier.server")

# The pool's page gauges (/metrics) are refreshed every this many iterations: a parked page
# set can hold thousands of pages, and a scrape every few seconds needs no fresher figure.
POOL_GAUGE_EVERY = 64


def fuse(model: Any, attention: bool = True) -> int:
    """The model's norms and gated MLPs as fused Triton kernels (`fused_kernels`), and with
    `attention` (`fused_attention`) its attention's rotary-and-page-write and q/k/v too; the
    modules swapped, 0 where Triton is missing (the model's own modules then run, as they
    would with the switch off)."""
    try:
        from kvtier.paged.fused import KINDS, fuse_model  # Triton: imported only when asked for
    except ImportError as exc:
        log.warning("fused kernels off: Triton is not importable (%s)", exc)
        return 0
    swapped = fuse_model(model, KINDS if attention else tuple(k for k in KINDS if k != "attention"))
    log.info("fused kernels: %d norms, MLPs and attentions swapped", swapped)
    return swapped


class BatchScheduler:
    """Owns the page pool and the scheduler thread; its steps run on `steps` (`StepRunner`)."""

    def __init__(
        self,
        served: ServedModel,
        backend: Backend,
        config: ServerConfig,
        metrics: Any = None,
        on_error: Callable[[BaseException], Any] | None = None,
    ) -> None:
        self.served = served
        self.backend = backend
        self.config = config
        self.metrics = metrics
        model = served.model
        if config.fused_kernels and served.device.type == "cuda":
            fuse(model, config.fused_attention)
        geometry, dtype, per_token = model_kv(model)
        self.max_batch = int(config.max_concurrency)
        self.batch_tokens = max(int(config.batch_tokens), self.max_batch)
        self.prefill_step = int(config.prefill_step)
        # prompt tokens of a step that also decodes (0: no lower budget than batch_tokens)
        self.decoding_prompt_tokens = int(config.decoding_prompt_tokens)
        # prompts one decoding step's budget takes whole go first: oldest first, or the
        # shortest first with `prompt_order` "shortest" (kvtier.server.batch.promptorder)
        self.prompts = PromptOrder(
            self.decoding_prompt_tokens or self.batch_tokens,
            self.prefill_step,
            config.prompt_order == "shortest",
        )
        # turns admitted in one step (0: no limit but the budget, slots and pages)
        self.admissions_per_step = int(config.admissions_per_step)
        self.pool: PagePool = make_pool(  # sharded by layer on a model placed across devices
            served,
            geometry,
            pool_bytes(served, config, per_token),
            page_size(served.device, dtype),
            dtype,
        )
        runner = BatchRunner(
            model,
            self.pool,
            max_batch=self.max_batch,
            max_tokens=self.batch_tokens,
            max_seq_len=served.context_tokens,
        )
        self._keep_kv = not isinstance(backend, RecomputeBackend)
        helpers = helper_threads(config, served.device)
        self._cond = threading.Condition()
        self.counters = Counters(metrics)
        # Paged L1 (`paged_l1`): the pool is the sessions' L1. A finished turn stores its new
        # chunks in L2 straight from its pages and parks them; the cache keeps no L1 copy.
        # The next turn starts from the parked pages, or restores from L2/L3 when they went.
        self._paged: PagedBackend | None = None  # the backend, when the pool is its L1
        if (
            config.paged_l1
            and isinstance(backend, PagedBackend)
            and config.codec == "native"
            and type(self.pool) is PagePool  # one device: not a pool sharded across devices
        ):
            self._paged = backend
        self.paged_l1 = self._paged is not None
        self.chunk_tokens = int(config.chunk_tokens)
        # the page manager. Parked pages (`park_pages`): a finished turn's pages stay as its
        # session's, the least recently parked going first; its next turn starts from them
        # (docs/architecture.md). Prefix pages are shared between a tenant's running turns;
        # not with a lossy codec (a session restored from L1 would read another's approximate
        # prefix, not its own).
        self.pages = Pages(
            self.pool,
            self._cond,
            self._paged,
            self.counters.count,
            park=(bool(config.park_pages) and self._keep_kv) or self.paged_l1,
            share=config.codec == "native",
            chunk_tokens=self.chunk_tokens,
        )
        # the model runner; overlapped steps (kvtier.server.batch.lookahead) unless turned off
        self.steps = StepRunner(
            runner,
            served,
            backend,
            max_batch=self.max_batch,
            overlap_steps=bool(config.overlap_steps),
            metrics=metrics,
        )
        # the policy, and the turns' queues it owns: what runs each step, what is admitted,
        # what is preempted
        self.turns = TurnScheduler(
            cond=self._cond,
            pages=self.pages,
            prompts=self.prompts,
            max_batch=self.max_batch,
            batch_tokens=self.batch_tokens,
            prefill_step=self.prefill_step,
            decoding_prompt_tokens=self.decoding_prompt_tokens,
            admissions_per_step=self.admissions_per_step,
        )
        self.queues: RunQueues = self.turns.queues
        # restores run on `helpers` threads, and finished turns commit (or abort) on as many of
        # their own; `on_error` hears of every error that fails a request (the engine's: a lost
        # device stops the server)
        self.restores = RestoreWorkers(
            backend,
            self._paged,
            self.pages,
            self.queues,
            helpers,
            float(config.queue_timeout),
            report=functools.partial(report_failure, on_error=on_error),
        )
        self.commits = TurnCommits(
            backend,
            self._paged,
            self.chunk_tokens,
            helpers,
            self.counters,
            release_l1=self.restores.release_l1,
            hand_back=self.pages.hand_back,
            on_error=on_error,
        )
        self._iterations = 0  # scheduler iterations, for the pool's gauges
        self._events = EventPost()  # this iteration's events, handed over together
        isolate = bool(config.isolate_cpus) and served.device.type == "cuda"
        self._switch_interval = tune_interpreter(config, served.device)  # given back at close
        if served.devices is not None:
            served.devices.attach(self)  # device failover runs on this scheduler's thread
        self._thread = threading.Thread(
            target=self._main, args=(isolate,), name="kvtier-batch", daemon=True
        )
        self._thread.start()

    # ---- the public side ----------------------------------------------------------------------

    def submit(self, job: Job, stream: Stream, admitted: float) -> concurrent.futures.Future[None]:
        """Queue a job; its events go to `stream`; the future resolves after Finished/Failed."""
        done: concurrent.futures.Future[None] = concurrent.futures.Future()
        tok = self.served.tokenizer
        s = Turn(
            job=job,
            stream=stream,
            admitted=admitted,
            done=done,
            reply=ReplyText(tok, self.served.eos_ids, job.stop, job.ignore_eos),
            gen=make_generator(job.temperature, job.seed),
            tokens=array("q", job.prompt_ids),
            decoding=decoding_of(job),
        )
        self.queues.submitted()
        self.restores.submit(s)
        return done

    def drop_parked(self, session_id: str, tenant: str) -> None:
        """Free the session's parked pages (if any, and not claimed by a turn on its way in)
        on the scheduler's thread, at its next iteration."""
        with self._cond:
            self.pages.drop_parked(Key(tenant, session_id))
            self._cond.notify_all()

    def close(self) -> None:
        """Stop once every submitted job has finished; then stop the restore and commit pools."""
        with self._cond:
            self.queues.closed = True
            self._cond.notify_all()
        self._thread.join()
        self.restores.shutdown()
        self.commits.shutdown()
        self.pages.close()  # the scheduler's thread is gone: the commits' pages go here
        sys.setswitchinterval(self._switch_interval)

    @property
    def running(self) -> list[Turn]:
        return self.queues.running

    @property
    def waiting(self) -> deque[Turn]:
        return self.queues.waiting

    # ---- the scheduler thread -----------------------------------------------------------------

    def _main(self, isolate: bool) -> None:
        if isolate:
            l3_io.isolate_caller()
        q = self.queues
        while True:
            with self._cond:
                while not (
                    q.arrived
                    or self.pages.dropping()
                    or q.busy()
                    or self.steps.pending
                    or q.closed
                    or self._devices()
                ):
                    self._cond.wait()
                q.take_arrived()
                self.pages.drop_asked()
                if q.closed and not (q.busy() or self.steps.pending):
                    if q.restoring == 0:
                        return
                    self._cond.wait()
                    continue
            try:
                self._iterate()
            except BaseException as exc:  # a bug here must not leave clients hanging
                log.exception("batch scheduler iteration failed")
                self.steps.pending = None
                for s in q.all():
                    self.fail(s, exc)

    def _devices(self) -> bool:
        """A device failover or restore waits to run (kvtier.server.devices.failover)."""
        return self.served.devices is not None and self.served.devices.pending

    def _iterate(self) -> None:
        q = self.queues
        if self.served.devices is not None:
            self._drain()
            self.served.devices.poll(self)  # between steps: fail over or restore a device
        cancelled = [s for s in q.all() if s.stream.cancelled.is_set()]
        if cancelled:
            self._drain()  # their tokens of the step in flight first
            for s in cancelled:
                if not s.gone:
                    self.finish(s, "cancelled")
        items = self.schedule()
        if items:
            self.run_step(items)
        else:
            self._drain()
            self.pages.wait_loading(q.running)
        self._deliver()
        self.report_dropped()
        self._iterations += 1
        idle = not q.busy()  # and when it goes idle, for an exact figure
        if idle or self._iterations % POOL_GAUGE_EVERY == 1:
            self.counters.pages(*self.pages.figures())

    def schedule(self) -> list[Item]:
        """The policy's schedule, after what it asks first: the turns it fails or cuts short,
        and the step in flight's tokens taken (then it schedules again)."""
        while True:
            plan: Schedule = self.turns.schedule(self.steps.pending is not None)
            for s, exc in plan.failed:
                self.fail(s, exc)
            if plan.cut is not None:
                self._out_of_room(plan.cut)
            if plan.drain:
                self._drain()
            elif not plan.again:
                return plan.items

    def report_dropped(self) -> None:
        """Paged L1: the sessions whose parked pages went are in L2/L3 alone now; the cache
        hears of it off this thread."""
        if self._paged is not None:
            for key in self.pages.dropped():
                self.commits.submit(self._paged_dropped, key)

    def _paged_dropped(self, key: Key) -> None:
        assert self._paged is not None
        try:
            self._paged.pages_dropped(key.session_id, key.tenant)
        except Exception:
            log.exception("marking session %s hibernated failed", key.session_id[:64])

    def settled(self, timeout: float) -> list[Turn]:
        """Running, waiting and arrived turns, once restores holding L1 have handed theirs
        over (at most `timeout` s): for a device failover (kvtier.server.devices.rehome)."""
        q = self.queues

        def over() -> bool:
            return self.restores.holding <= len(q.all()) + len(q.arrived)

        with self._cond:
            self._cond.wait_for(over, timeout=timeout)
            return [*q.all(), *q.arrived]

    def fail_queued(self, s: Turn, exc: BaseException) -> None:
        """Fail a turn that may still be in the arrived list."""
        with self._cond:
            if s in self.queues.arrived:
                self.queues.arrived.remove(s)
        self.fail(s, exc)

    # ---- device failover's port (kvtier.server.devices.failover.SchedulerPort) ----------------

    def locked(self) -> threading.Condition:
        """The scheduler's lock (its condition), as a context manager: what another thread
        hands over to this one is changed under it. Re-entrant: `wakeup` may run inside."""
        return self._cond

    def wakeup(self) -> None:
        """Wake the scheduler thread: there is work for it (a device request)."""
        with self._cond:
            self._cond.notify_all()

    def evacuate(self, keep: bool) -> None:
        """Every running turn leaves the pool and waits at the head of the queue, in its order
        (`TurnScheduler.evacuate`); one whose K/V could not be kept fails. On the scheduler's
        thread, between steps."""
        for s, exc in self.turns.evacuate(keep):
            self.fail(s, exc)

    def detach_pool(self) -> PagePool:
        """Let go of the page pool and the runner; returns the pool. No step may run until
        `install_pool` gives new ones."""
        pool = self.pool
        self.pool = self.steps.runner = None  # type: ignore[assignment]  # until install_pool
        return pool

    def install_pool(self, pool: PagePool, runner: BatchRunner) -> None:
        """A new page pool and its runner (after `detach_pool`)."""
        self.pool = pool
        self.pages.replace_pool(pool)
        self.steps.replace_runner(runner)

    @property
    def runner(self) -> BatchRunner:
        """The model runner's `BatchRunner` (its inputs and CUDA graphs)."""
        return self.steps.runner

    @property
    def graphed(self) -> bool:
        """Whether the step is to replay CUDA graphs: `cuda_graphs` asks and the pool is on one
        CUDA device (a graph cannot span the devices of a model placed across several)."""
        return (
            bool(self.config.cuda_graphs)
            and self.pool.device.type == "cuda"
            and self.served.devices is None
        )

    def capture_graphs(self) -> list[int]:
        """Record the step as CUDA graphs (with `decode_graphs`, the decode-only ones too),
        before the first turn; the buckets captured, none where the step is not `graphed`."""
        if not self.graphed:
            return []
        return self.runner.capture_graphs(decode_graphs=decode_graphs(self.config))

    # ---- the step and its outcome -------------------------------------------------------------

    def run_step(self, items: list[Item]) -> None:
        """Run a step of `items` (`StepRunner.step`), then end the turns it ended."""
        self._ended(self.steps.step(items))

    def _drain(self) -> None:
        """Take the step in flight's tokens (`StepRunner.drain`), and end the turns it ended."""
        self._ended(self.steps.drain())

    def _ended(self, out: StepOutput) -> None:
        """What the steps gave their turns, in order: the first token's time, the text, and the
        end of each reply that ended (or the fault of each that failed); a failed forward
        fails its turns, unless a device was lost (they wait for the survivors)."""
        for o in out.turns:
            s = o.turn
            if o.ttft is not None:
                self.observe_ttft(s, o.ttft)
            if o.streams:
                self.post(s, Delta(o.text, o.logprobs))
            if o.fault is not None:
                self.fail(s, o.fault)
            elif o.reason is not None:
                self.finish(s, o.reason, flush=o.flush)
        if out.failed is not None:
            exc, items = out.failed.exc, out.failed.items
            devices = self.served.devices
            if devices is not None and devices.lost_in_step(self, exc, items):
                return  # a device was lost: its turns wait to run on the survivors
            log.error("batched forward failed (%d sequences)", len(items), exc_info=exc)
            for s, _ in items:
                self.fail(s, exc)

    def observe_ttft(self, s: Turn, seconds: float) -> None:
        """A turn's first token came `seconds` after its submission."""
        if s.restored is not None and not s.job.internal:
            self.counters.ttft(s.restored.source, seconds)

    def post(self, s: Turn, event: Delta) -> None:
        self._events.post(s.stream, event)

    def _deliver(self) -> None:
        self._events.send()

    def _out_of_room(self, s: Turn) -> None:
        """Alone in a full pool: the reply ends here, as at the end of the context."""
        log.warning(
            "session %s: the batch KV pool is full with this one reply; it ends at %d tokens "
            "(raise batch_kv_bytes)",
            s.job.session_id[:64],
            s.fed,
        )
        self.finish(s, "length", flush=True)

    # ---- leaving ------------------------------------------------------------------------------

    def _leave(self, s: Turn) -> None:
        held = s.end()
        self.pages.leave(s, held)
        self.queues.leave(s)

    def finish(self, s: Turn, reason: str, flush: bool = False) -> None:
        """End the turn: its reply's last events, its pages parked or freed, and its commit off
        this thread (which holds the pages it stores from until it is done)."""
        self._leave(s)
        if flush:
            rest = s.reply.rest()
            if rest:
                self.post(s, Delta(rest))
        fed = s.fed
        try:
            if self.paged_l1:
                chunks = self.pages.chunks_out(s)
            else:
                new = self.pages.copy_out(s) if (self._keep_kv and s.paged is not None) else None
        except BaseException as exc:
            self.fail(s, exc)
            return
        if reason != "cancelled" and self.pages.park(s):
            s.park()
        else:  # a client gone: its L1 is freed too
            self.pages.release(s)
        self._deliver()  # its deltas reach the client before Finished
        if self.paged_l1:
            self.commits.submit(self.commits.commit_pages, s, reason, fed, chunks)
        else:
            self.commits.submit(self.commits.commit_cache, s, reason, fed, new)

    def fail(self, s: Turn, exc: BaseException) -> None:
        """The request fails: free its pages, and abort its session off this thread."""
        self.commits.error(exc)
        self._leave(s)
        self.pages.release(s)
        self._deliver()
        self.commits.submit(self.commits.abort, s, exc)
