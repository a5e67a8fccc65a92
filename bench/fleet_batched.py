"""(d, e) of `bench/fleet_concurrent.py`: kvtier's BatchScheduler (the server's) serving the
fleet in-process, one asyncio client per session."""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from array import array
from collections import Counter
from types import SimpleNamespace
from typing import Any

import torch
from fleet_serve import TENANT, Fleet, Measure, Window, count_sources, seed, session_name
from stacks import StackSampler

from kvtier.server.batch.batching import BatchScheduler
from kvtier.server.batch.jobs import Delta, Job, Started, Stream
from kvtier.server.devices.model import ServedModel, byte_tokenizer

# ---- (d, e) kvtier batched: the BatchScheduler -------------------------------------------------


class StepLog:
    """The scheduler's metrics hook: every step's (end time, seconds, sequences)."""

    def __init__(self) -> None:
        self.steps: list[tuple[float, float, int, bool]] = []
        self.ttfts: list[tuple[str, float]] = []
        self.decode_only = False  # the kind of the step now running (set by `watch`)
        self.prompt_tokens = 0  # prompt-chunk tokens of the step now running
        self.prompts: list[int] = []  # prompt-chunk tokens of every step, in `steps` order
        # host work of the scheduler between two step completions: (admissions, finished
        # turns) since the step before, in `steps` order (`watch_scheduler`)
        self.host: list[tuple[int, int]] = []
        self._admits = self._finishes = 0
        # host seconds of the scheduler thread between two step completions, in `steps` order:
        # (launching the next step: inputs + replay, waiting for the GPU's tokens). A wait near
        # 0 means the GPU had finished first: the host set that step's pace, not the GPU.
        self.thread: list[tuple[float, float]] = []
        self._launch_s = self._wait_s = 0.0
        # on CUDA, each forward's (host time after its launch, event before it, event after
        # it) on the stream: the GPU's idle time between two steps (`gpu_gaps`)
        self.gpu_marks: list[tuple[float, Any, Any]] = []

    def watch(self, runner: Any) -> None:
        """Note, before each forward, whether the step is decode-only (one token per sequence:
        the Triton kernel on CUDA) or mixes prompt chunks in (the reference path on torch
        without paged varlen attention). Observes; changes nothing."""
        step = runner.step
        cuda = runner.pool.device.type == "cuda"

        def observed(batch: Any, *feed: Any) -> Any:
            self.decode_only = all(len(item.tokens) == 1 for item in batch)
            self.prompt_tokens = sum(len(item.tokens) for item in batch if len(item.tokens) > 1)
            t0 = time.perf_counter()
            before = after = None
            if cuda:
                before = torch.cuda.Event(enable_timing=True)
                before.record()
            try:
                return step(batch, *feed)
            finally:
                if cuda:
                    after = torch.cuda.Event(enable_timing=True)
                    after.record()
                    self.gpu_marks.append((time.perf_counter(), before, after))
                self._launch_s += time.perf_counter() - t0

        runner.step = observed

    def watch_scheduler(self, sched: Any) -> None:
        """Count the scheduler's admissions (copy into the pages) and finished turns (copy out,
        commit queued) between step completions. Observes; changes nothing."""
        admit, finish = sched.pages.admit, sched.finish

        def admitted(*a: Any, **k: Any) -> Any:
            self._admits += 1
            return admit(*a, **k)

        def finished(*a: Any, **k: Any) -> Any:
            self._finishes += 1
            return finish(*a, **k)

        sched.pages.admit, sched.finish = admitted, finished
        start = sched.steps.readback.start

        def started(logits: Any, *a: Any, **k: Any) -> Any:  # time the wait for each step's tokens
            tokens, ticket = start(logits, *a, **k)
            return tokens, _TimedTicket(ticket, self)

        sched.steps.readback.start = started

    def count(self, name: str, n: int = 1) -> None:
        return None

    def ttft(self, source: str, seconds: float) -> None:
        self.ttfts.append((source, seconds))

    def step(self, batch_size: int, seconds: float) -> None:
        self.steps.append((time.perf_counter(), seconds, batch_size, self.decode_only))
        self.prompts.append(self.prompt_tokens)
        self.host.append((self._admits, self._finishes))
        self._admits = self._finishes = 0
        self.thread.append((self._launch_s, self._wait_s))
        self._launch_s = self._wait_s = 0.0


class _TimedTicket:
    """A step's ticket whose wait is timed into the log. A wrapper, not the ticket's `wait`
    replaced by a closure over itself: that made a reference cycle per step, and the bench's
    window then held collections that the server's never does."""

    def __init__(self, ticket: Any, log: StepLog) -> None:
        self._ticket, self._log = ticket, log
        self.kept = ticket.kept  # the rows the host samples itself, valid once waited for

    def wait(self) -> Any:
        t0 = time.perf_counter()
        try:
            return self._ticket.wait()
        finally:
            self._log._wait_s += time.perf_counter() - t0


def served_model(model) -> ServedModel:
    """The model as the server sees it, with the byte tokenizer and sampling kept to printable
    ASCII (as `kvtier serve` does for its built-in model), so that a reply's text gives back its
    token ids (byte value == token id) and the next turn's prompt extends the committed tokens."""
    vocab = int(model.config.vocab_size)
    allowed = torch.zeros(vocab, dtype=torch.bool)
    allowed[32:127] = True
    allowed[10] = True
    device = next(model.parameters()).device
    context = int(getattr(model.config, "max_position_embeddings", 0) or 32768)
    return ServedModel(
        model, byte_tokenizer(), context, frozenset(), allowed.to(device), "bench-fleet"
    )


def run_batched(
    name: str,
    model,
    fleet: Fleet,
    bank,
    device: str,
    warmup: float,
    limit: float,
    backend,
    sched_config: SimpleNamespace,
) -> Measure:
    """kvtier's BatchScheduler (the server's, without HTTP): one asyncio client per session
    submits a turn, reads its tokens, thinks, and submits the next. As `kvtier serve`'s engine,
    at most `max_concurrency` turns are submitted at once (the others wait for a slot), so the
    scheduler restores no more sessions than the batch holds. TTFT counts from the end of the
    think time (the wait for a slot included) to the first token's arrival at the client."""
    m = Measure(name)
    m.extra["seed_s"] = round(seed(backend.cache, fleet, bank, device), 1)
    log = StepLog()
    sched = BatchScheduler(served_model(model), backend, sched_config, log)
    if sched.graphed:
        t0 = time.perf_counter()  # as `kvtier serve`'s warm-up: before the first request
        m.extra["graphs"] = sched.capture_graphs()
        m.extra["graph_capture_s"] = round(time.perf_counter() - t0, 2)
    log.watch(sched.runner)  # before the first submit: the scheduler thread is idle until then
    log.watch_scheduler(sched)
    phases = trace_phases(sched)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="fleet-clients", daemon=True)
    thread.start()
    win = Window(device, warmup, limit, segments=bool(getattr(sched_config, "stacks", False)))
    # arrival and tokens of every delta; arrays, which the collector never walks (a list of
    # tuples grew by one per token and was walked by every collection that reached it)
    arrivals, counts = array("d"), array("q")
    slot_waits: list[float] = []  # each turn's wait for a generation slot
    sources: list[str] = []  # returning turns inside the window: where their prefix came from

    async def client(sid: int, slots: asyncio.Semaphore) -> None:
        # tuples, as `kvtier serve` keeps a prompt: a real client holds its context in another
        # process, and lists here would give the collector millions of references to walk
        # that no server has (docs/benchmarks-history.md, "What the collector walks")
        ctx = tuple(fleet.contexts[sid])
        conv, turn = 0, 1
        while True:
            wake = time.perf_counter() + fleet.think_s(sid, turn)
            await asyncio.sleep(max(0.0, min(wake, win.close_at) - time.perf_counter()))
            if win.over():
                return
            returning = True
            if len(ctx) > len(fleet.contexts[sid]) + fleet.max_growth:
                conv, ctx, returning = conv + 1, tuple(fleet.contexts[sid]), False
            prompt = ctx + tuple(fleet.append(sid, turn))
            turn += 1
            job = Job(session_name(sid, conv), TENANT, prompt, fleet.decode, temperature=0.0)
            stream = Stream(loop=asyncio.get_running_loop())
            submitted = time.perf_counter()
            first = None
            slot_wait = 0.0
            source = "?"
            text: list[str] = []
            try:
                async with slots:  # the server's generation slots (Engine: max_concurrency)
                    if win.over():
                        return
                    slot_wait = time.perf_counter() - submitted
                    sched.submit(job, stream, submitted)
                    async for ev in stream.events():
                        if isinstance(ev, Started):  # restored: from which tier
                            source = ev.source
                        if isinstance(ev, Delta) and ev.text:
                            now = time.perf_counter()
                            first = first if first is not None else now
                            text.append(ev.text)
                            arrivals.append(now)
                            counts.append(len(ev.text))
            except Exception as exc:  # counted; the scheduler aborted the turn
                m.fail(exc)
                continue
            if first is not None and win.inside(first):  # as the phases: first token inside
                slot_waits.append(slot_wait)
            if first is not None and returning and win.inside(first):
                m.ttft.append(first - submitted)
                m.turns += 1
                sources.append(source)
            ctx = prompt + tuple("".join(text).encode("utf-8"))

    async def fleet_main() -> None:
        slots = asyncio.Semaphore(int(sched_config.max_concurrency))
        await asyncio.gather(*(client(s, slots) for s in range(len(fleet.contexts))))

    sampler = None
    if getattr(sched_config, "stacks", False):
        sampler = StackSampler(garbage=bool(getattr(sched_config, "gc_garbage", False)))

    stored: list[tuple[dict[str, int], Any]] = []  # the cache's writes at the open, the close
    resident: list[int] = []  # sessions with K/V in the pool when the window closes

    def writes() -> tuple[dict[str, int], Any]:
        return backend.cache.counters.copy().stored, backend.cache.l3.stats()

    async def poll() -> None:
        while win.after is None:
            win.poll()
            if win.opened and not stored:
                stored.append(writes())  # at the window's open
            if win.after is not None and len(stored) == 1:
                stored.append(writes())  # and at its close
            if win.after is not None and not resident:
                resident.append(resident_sessions(sched))
            if sampler is not None and win.opened and not sampler.started:
                sampler.start()  # the scheduler thread's stacks, inside the window only
            await asyncio.sleep(0.05)
        if sampler is not None:
            sampler.stop()
            steps = [(t, sec) for t, sec, _, _ in list(log.steps) if win.inside(t)]
            m.extra["stacks"] = "\n".join(
                part for part in (sampler.report(), sampler.tail_report(steps)) if part
            )

    fut = asyncio.run_coroutine_threadsafe(fleet_main(), loop)
    poller = asyncio.run_coroutine_threadsafe(poll(), loop)
    try:
        fut.result(timeout=limit + 120)  # the last turns finish after the window closes
        poller.result(timeout=5)
    finally:
        win.finish(m)
        sched.close()
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
    m.tokens = sum(k for t, k in zip(arrivals, counts, strict=True) if win.inside(t))
    inside = [(s, b, d) for t, s, b, d in log.steps if win.inside(t)]
    m.steps = [s for s, _, _ in inside]
    m.extra["mean_batch"] = sum(b for _, b, _ in inside) / max(len(inside), 1)
    m.extra["max_batch"] = max((b for _, b, _ in inside), default=0)
    m.extra["returning_sources"] = count_sources(sources)
    m.extra["resident_sessions"] = resident[0] if resident else resident_sessions(sched)
    only = [s for s, _, d in inside if d]
    mixed = [s for s, _, d in inside if not d]
    m.extra["decode_only_steps"] = len(only)
    m.extra["mixed_steps"] = len(mixed)
    m.extra["step_p50_decode_only"] = _median(only)
    m.extra["step_p50_mixed"] = _median(mixed)
    chunks = [
        p for (t, _, _, d), p in zip(log.steps, log.prompts, strict=True) if win.inside(t) and not d
    ]
    m.extra["mixed_prompt_tokens_p50"] = _median([float(p) for p in chunks])
    m.extra["step_tail"] = step_tail(log, win)
    m.extra["gpu_gaps"] = gpu_gaps(log, win)
    m.extra["preemptions"] = sched.pages.preemptions
    m.extra["graph_steps"] = sched.runner.graph_steps
    m.extra["eager_steps"] = sched.runner.eager_steps
    m.extra["server_ttft_p50"] = _median([s for _, s in log.ttfts])
    if len(stored) == 2:
        m.extra["stored"] = stored_in_window(*stored[0], *stored[1], backend, m.window)
    inside = [p for t, p in phases if win.inside(t)]
    if inside:
        names = ("queued", "restore", "of which L1 room", "waiting", "copy-in", "steps", "total")
        m.extra["ttft_phases_p50_ms"] = {
            "slot": round(_median(slot_waits) * 1000, 1),  # part of "queued"
            **{
                n: round(_median([p[1 + i] for p in inside]) * 1000, 1) for i, n in enumerate(names)
            },
        }
        m.extra["restore_sources"] = dict(Counter(p[0] for p in inside))
        # the slowest twentieth of the turns (by server TTFT): what their time went to
        slow = sorted(inside, key=lambda p: p[-1])[-max(1, len(inside) // 20) :]
        m.extra["ttft_phases_slowest_ms"] = {
            n: round(sum(p[1 + i] for p in slow) / len(slow) * 1000, 1) for i, n in enumerate(names)
        }
        m.extra["slowest_sources"] = dict(Counter(p[0] for p in slow))
    return m


def resident_sessions(sched: BatchScheduler) -> int:
    """Sessions whose K/V is in the page pool now: parked between turns or in a running turn
    (read from another thread: retried if the scheduler changed them meanwhile; -1 if it kept
    changing them)."""
    for _ in range(20):
        try:
            keys = set(list(sched.pages.tables.parked))
            keys |= {(s.job.tenant, s.job.session_id) for s in list(sched.running)}
            return len(keys)
        except RuntimeError:  # changed size during iteration
            time.sleep(0.001)
    return -1


def gpu_gaps(log: StepLog, win: Any) -> dict[str, float]:
    """The GPU's idle time between consecutive forwards inside the window: from the event
    after one step's work to the event before the next step's (a timestamp taken when the GPU
    reaches it: 0 when the next step was queued before the last one finished). P50, P90, mean,
    and the share of gaps over 0.3 ms, in ms. Empty off CUDA or with fewer than 2 steps."""
    marks = [(b, a) for t, b, a in log.gpu_marks if win.inside(t)]
    if len(marks) < 2:
        return {}
    torch.cuda.synchronize()
    gaps = sorted(
        max(0.0, prev_after.elapsed_time(next_before))
        for (_, prev_after), (next_before, _) in itertools.pairwise(marks)
    )
    n = len(gaps)
    return {
        "gaps": n,
        "p50_ms": round(gaps[n // 2], 3),
        "p90_ms": round(gaps[int(n * 0.9)], 3),
        "mean_ms": round(sum(gaps) / n, 3),
        "over_0_3_ms": round(sum(g > 0.3 for g in gaps) / n, 3),
    }


def step_tail(log: StepLog, win: Any) -> dict[str, dict[str, float]]:
    """What the slowest steps had in common: the steps inside the window above their P90 (the
    tail) against those at or below their P50 (the body), each with its mean batch, share of
    steps with prompt chunks, mean prompt tokens, mean admissions and finished turns the
    scheduler handled since the step before, and the scheduler thread's time launching the next
    step and waiting for the GPU in that interval. Empty with fewer than 20 steps."""
    rows = [
        (sec, batch, not only, prompt, host, thread)
        for (t, sec, batch, only), prompt, host, thread in zip(
            log.steps, log.prompts, log.host, log.thread, strict=True
        )
        if win.inside(t)
    ]
    if len(rows) < 20:
        return {}
    ordered = sorted(r[0] for r in rows)
    p50, p90 = ordered[len(ordered) // 2], ordered[int(len(ordered) * 0.9)]

    def describe(
        group: list[tuple[float, int, bool, int, tuple[int, int], tuple[float, float]]],
    ) -> dict[str, float]:
        n = max(len(group), 1)
        return {
            "steps": len(group),
            "mean_ms": round(sum(r[0] for r in group) / n * 1000, 1),
            "batch": round(sum(r[1] for r in group) / n, 1),
            "mixed": round(sum(r[2] for r in group) / n, 2),
            "prompt_tokens": round(sum(r[3] for r in group) / n, 1),
            "admissions": round(sum(r[4][0] for r in group) / n, 2),
            "finished": round(sum(r[4][1] for r in group) / n, 2),
            "launch_ms": round(sum(r[5][0] for r in group) / n * 1000, 2),
            "wait_ms": round(sum(r[5][1] for r in group) / n * 1000, 2),
        }

    return {
        "tail": describe([r for r in rows if r[0] > p90]),
        "body": describe([r for r in rows if r[0] <= p50]),
    }


def trace_phases(sched: BatchScheduler) -> list[tuple[float, tuple[Any, ...]]]:
    """Where each turn's server-side time to its first token went (its `TurnTrace`): (when,
    (restore source, queued, restore, its wait for L1 room, waiting, copy-in, steps, total) in
    seconds), recorded as
    the scheduler observes the first token. Observes; changes nothing."""
    out: list[tuple[float, tuple[Any, ...]]] = []
    observe = sched.observe_ttft

    def observed(s: Any, seconds: float) -> None:
        t = s.trace
        source = s.restored.source if s.restored is not None else "?"
        out.append(
            (
                time.perf_counter(),
                (
                    source,
                    t.restore - s.admitted,
                    t.restored - t.restore,
                    t.room_wait_s,
                    t.admit - t.restored,
                    t.copy_in_s,
                    t.step_s,
                    seconds,
                ),
            )
        )
        observe(s, seconds)

    sched.observe_ttft = observed  # type: ignore[method-assign]
    return out


def _median(values: list[float]) -> float:
    if not values:
        return float("nan")
    v = sorted(values)
    return v[len(v) // 2]


def stored_in_window(c0, l3_0, c1, l3_1, backend, window: float) -> dict[str, float]:
    """What the window's commits stored: chunks offloaded to L2 (and queued for L3) per
    second, the partial tail chunks' share of them, and what the L3 writers put on disk (MB/s,
    and their busy seconds per second of window)."""
    per_token = backend.cache.geometry.bytes_per_token
    d = {k: c1[k] - c0[k] for k in c0}
    return {
        "chunks_per_s": d["chunks"] / window,
        "tails_per_s": d["tails"] / window,
        "tail_token_share": d["tail_tokens"] / max(d["tokens"], 1),
        "l2_mb_per_s": d["tokens"] * per_token / window / 1e6,
        "tail_l2_mb_per_s": d["tail_tokens"] * per_token / window / 1e6,
        "l3_mb_per_s": (l3_1.bytes_written - l3_0.bytes_written) / window / 1e6,
        "l3_write_busy": (l3_1.write_seconds - l3_0.write_seconds) / window,
    }
