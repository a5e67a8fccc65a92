"""The server's own Prometheus metrics (requests by endpoint and status code, tokens, TTFT by
restore source, request latencies as vLLM reports them, queue depth, the GPU memory plan).

They are registered in the registry the caller passes in, so `ops` can serve them next to the
cache and host metrics on one `/metrics` without kvtier importing ops.
"""

from __future__ import annotations

import gc
import time
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics

if TYPE_CHECKING:  # pragma: no cover
    from kvtier.server.reqmetrics import TurnClock

# `reason` of kvtier_commit_failures_total (kvtier.server.batch.committing.failure_reason)
COMMIT_FAILURE_REASONS = ("device_oom", "l3_full", "l3_io", "l4", "internal")
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
GC_BUCKETS = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25)
# a whole request, and its wait for admission (queue_timeout is 30 s by default)
E2E_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)
QUEUE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
# one token's time: a batched decode step is 10-30 ms on a GPU
TOKEN_BUCKETS: tuple[float, ...] = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04)
TOKEN_BUCKETS += (0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)


class ServerMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry
        # no `_created` gauge beside each counter and histogram: a series per family that no
        # dashboard reads (process-wide: every prometheus_client family of the process)
        disable_created_metrics()
        self.requests = Counter(
            "kvtier_server_requests_total",
            "Responses of the /v1 endpoints by route template and status code (a streamed one "
            "when it ends).",
            ["endpoint", "code"],
            registry=registry,
        )
        self.errors = Counter(
            "kvtier_server_request_errors_total",
            "Completion requests answered with a 4xx or 5xx.",
            registry=registry,
        )
        self.bad_requests = Counter(
            "kvtier_server_bad_requests_total",
            "Requests answered 400, by reason: the error's code (e.g. context_length_exceeded), "
            "else invalid_request.",
            ["reason"],
            registry=registry,
        )
        self.rejected = Counter(
            "kvtier_server_rejected_total",
            "Requests refused with 429 because no generation slot freed in time.",
            registry=registry,
        )
        self.commit_failures = Counter(
            "kvtier_commit_failures_total",
            "Finished turns whose commit of new K/V failed (the reply was delivered; the K/V "
            "past the session's stored prefix is recomputed at its next turn), by reason: "
            "device_oom, l3_full, l3_io, l4, internal.",
            ["reason"],
            registry=registry,
        )
        for reason in COMMIT_FAILURE_REASONS:  # every series from 0, for rate() in the alert
            self.commit_failures.labels(reason=reason)
        self.prompt_tokens = Counter(
            "kvtier_server_prompt_tokens_total", "Prompt tokens processed.", registry=registry
        )
        self.completion_tokens = Counter(
            "kvtier_server_completion_tokens_total", "Tokens generated.", registry=registry
        )
        self.ttft_seconds = Histogram(
            "kvtier_server_ttft_seconds",
            "Admission to first token, by where the prompt's KV came from.",
            ["src"],
            buckets=TTFT_BUCKETS,
            registry=registry,
        )
        # a turn's latencies, as vLLM's families of the same names (kvtier.server.reqmetrics)
        self.e2e_seconds = Histogram(
            "kvtier_server_e2e_request_latency_seconds",
            "Arrival of a completion request to its last token.",
            buckets=E2E_BUCKETS,
            registry=registry,
        )
        self.queue_seconds = Histogram(
            "kvtier_server_request_queue_time_seconds",
            "Arrival of a completion request to its turn's admission into the batch.",
            buckets=QUEUE_BUCKETS,
            registry=registry,
        )
        self.tpot_seconds = Histogram(
            "kvtier_server_time_per_output_token_seconds",
            "A request's first token to its last, over its tokens after the first.",
            buckets=TOKEN_BUCKETS,
            registry=registry,
        )
        self.inter_token_seconds = Histogram(
            "kvtier_server_inter_token_latency_seconds",
            "Time between two consecutive tokens of a turn.",
            buckets=TOKEN_BUCKETS,
            registry=registry,
        )
        self.running = Gauge(
            "kvtier_server_running_requests", "Requests generating now.", registry=registry
        )
        self.queued = Gauge(
            "kvtier_server_queued_requests", "Requests waiting for a slot.", registry=registry
        )

        self.batch_size = Histogram(
            "kvtier_server_batch_size",
            "Sequences in one forward of the batching scheduler.",
            buckets=BATCH_BUCKETS,
            registry=registry,
        )
        self.step_seconds = Histogram(
            "kvtier_server_step_seconds",
            "Time of one batching-scheduler step (forward and sampling).",
            buckets=STEP_BUCKETS,
            registry=registry,
        )

        self.device_count = Gauge(
            "kvtier_server_devices",
            "Devices of a model placed across devices, by state (ok or lost).",
            ["state"],
            registry=registry,
        )
        self.degraded = Gauge(
            "kvtier_server_degraded",
            "1 while a lost device's layers run on the survivors (or a device is returning).",
            registry=registry,
        )
        self.grammar_cache_bytes = Gauge(
            "kvtier_server_grammar_cache_bytes",
            "Compiled grammars kept for structured output (bounded by --grammar-cache-bytes).",
            registry=registry,
        )
        self.grammar_cache_entries = Gauge(
            "kvtier_server_grammar_cache_entries",
            "Compiled grammars kept for structured output.",
            registry=registry,
        )
        self.failover_seconds = Gauge(
            "kvtier_server_failover_seconds",
            "Time of the last device failover, from the fault to serving again.",
            registry=registry,
        )
        self.degraded_turns = Counter(
            "kvtier_server_degraded_turns_total",
            "Turns that ran, wholly or partly, while the server was degraded.",
            registry=registry,
        )

        self.streaming_turns = Counter(
            "kvtier_server_streaming_turns_total",
            "Degraded turns run over attention sinks plus a sliding window (--degraded-window).",
            registry=registry,
        )
        self.shared_kv_pages = Counter(
            "kvtier_server_shared_kv_pages_total",
            "Full KV pages of a restored prefix that an admitted turn took from a running turn "
            "of its tenant instead of copying them (batching scheduler).",
            registry=registry,
        )
        self.parked_turns = Counter(
            "kvtier_server_parked_turns_total",
            "Returning turns that started from their session's parked KV pages instead of a "
            "copy of their restored prefix (batching scheduler, --park-pages).",
            registry=registry,
        )
        self.int8_kv_turns = Counter(
            "kvtier_server_int8_kv_turns_total",
            "Degraded turns whose K/V was read, wholly or partly, from int8 pages (--degraded-kv).",
            registry=registry,
        )

        self.kv_pages = Gauge(
            "kvtier_server_kv_pages",
            "Pages of the batch's KV pool (batching scheduler), by state: parked (finished "
            "turns' pages kept for their sessions' next turns: with paged L1 the sessions' L1), "
            "running (every other page in use) and free.",
            ["state"],
            registry=registry,
        )
        self._kv_pages = {s: self.kv_pages.labels(state=s) for s in ("parked", "running", "free")}
        self.kv_page_bytes = Gauge(
            "kvtier_server_kv_page_bytes",
            "Bytes of one page of the batch's KV pool (every layer's K and V).",
            registry=registry,
        )

        self.gc_pause_seconds = Histogram(
            "kvtier_server_gc_pause_seconds",
            "Python's cyclic garbage collections while serving, by generation: each holds every "
            "thread of the process, the batch scheduler's included.",
            ["generation"],
            buckets=GC_BUCKETS,
            registry=registry,
        )
        # One child per generation, made now: the callback must not take the family's lock.
        # A scrape copies the family's children under that (non-reentrant) lock, the copy may
        # start a collection in the scraping thread, and the callback runs in that thread.
        self._gc_pause = {g: self.gc_pause_seconds.labels(generation=str(g)) for g in range(3)}
        self._gc_start = 0.0
        # The GPU memory plan's families, registered by the first `gpu_memory_plan` call: a
        # server without a plan (the CPU, a model across devices) has none, not a 0 budget.
        self.gpu_memory: Gauge | None = None
        self.gpu_memory_budget: Gauge | None = None
        self.gpu_memory_used: Gauge | None = None
        self._gpu_parts: set[str] = set()

    def watch_gc(self, on: bool = True) -> None:
        """Time every garbage collection of the process (`gc.callbacks`) from now on, or stop."""
        if on and self._on_gc not in gc.callbacks:
            gc.callbacks.append(self._on_gc)
        elif not on and self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._gc_start = time.perf_counter()
        elif self._gc_start and (child := self._gc_pause.get(info["generation"])) is not None:
            child.observe(time.perf_counter() - self._gc_start)

    def gpu_memory_plan(self, plan: Any) -> None:
        """Export the GPU memory plan (kvtier.server.devices.memplan.DeviceMemoryPlan): each part's
        bytes (`plan.parts()`), the budget they fill (`plan.budget_bytes`), and the bytes the
        process holds on the device, read at every scrape (`plan.used_bytes()`). Called again
        with a newer plan (the measured figures recorded), it replaces the figures."""
        if self.gpu_memory is None:
            self.gpu_memory = Gauge(
                "kvtier_gpu_memory_bytes",
                "Bytes of the GPU memory plan by part: weights, activations, graphs, staging, "
                "l1, inflight, pool and headroom; they sum to the budget.",
                ["part"],
                registry=self._registry,
            )
            self.gpu_memory_budget = Gauge(
                "kvtier_gpu_memory_budget_bytes",
                "The process's one GPU memory budget (--gpu-memory-utilization of the device).",
                registry=self._registry,
            )
            self.gpu_memory_used = Gauge(
                "kvtier_gpu_memory_process_bytes",
                "Bytes the process holds on the device now (the CUDA caching allocator's "
                "reserved bytes), against the budget.",
                registry=self._registry,
            )
        assert self.gpu_memory_budget is not None and self.gpu_memory_used is not None
        parts = {str(p): int(n) for p, n in plan.parts().items()}
        for stale in self._gpu_parts - parts.keys():  # a part the newer plan no longer has
            self.gpu_memory.remove(stale)
        for part, nbytes in parts.items():
            self.gpu_memory.labels(part=part).set(nbytes)
        self._gpu_parts = set(parts)
        self.gpu_memory_budget.set(int(plan.budget_bytes))
        self.gpu_memory_used.set_function(plan.used_bytes)

    def devices(self, ok: int, lost: int, state: str, failover_s: float | None = None) -> None:
        self.device_count.labels(state="ok").set(ok)
        self.device_count.labels(state="lost").set(lost)
        self.degraded.set(0 if state == "healthy" else 1)
        if failover_s is not None:
            self.failover_seconds.set(failover_s)

    def grammar_cache(self, size: int, entries: int) -> None:
        self.grammar_cache_bytes.set(size)
        self.grammar_cache_entries.set(entries)

    def count(self, name: str, n: int = 1) -> None:
        {
            "rejected": self.rejected,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "errors": self.errors,
            "degraded_turns": self.degraded_turns,
            "streaming_turns": self.streaming_turns,
            "int8_kv_turns": self.int8_kv_turns,
            "shared_kv_pages": self.shared_kv_pages,
            "parked_turns": self.parked_turns,
        }[name].inc(n)

    def commit_failure(self, reason: str) -> None:
        self.commit_failures.labels(reason=reason).inc()

    def bad_request(self, reason: str) -> None:
        self.bad_requests.labels(reason=reason).inc()

    def request(self, endpoint: str, code: int) -> None:
        """A response of a /v1 endpoint ended (kvtier.server.reqmetrics.RequestMetrics)."""
        self.requests.labels(endpoint=endpoint, code=str(code)).inc()

    def turn_ended(self, clock: TurnClock) -> None:
        """A turn is over: its queue time once admitted, its end-to-end latency once it
        produced a token, its time per output token once it produced two."""
        if clock.admitted:
            self.queue_seconds.observe(max(0.0, clock.admitted - clock.arrived))
        if clock.tokens:
            self.e2e_seconds.observe(max(0.0, clock.last - clock.arrived))
        if clock.tokens > 1:
            self.tpot_seconds.observe((clock.last - clock.first) / (clock.tokens - 1))

    def ttft(self, source: str, seconds: float) -> None:
        self.ttft_seconds.labels(src=source).observe(seconds)

    def load(self, running: int, waiting: int) -> None:
        self.running.set(running)
        self.queued.set(waiting)

    def pages(self, parked: int, free: int, total: int, page_bytes: int) -> None:
        """The batch's page pool: `parked` pages (of parked tables), `free`, of `total`."""
        self._kv_pages["parked"].set(parked)
        self._kv_pages["running"].set(total - parked - free)
        self._kv_pages["free"].set(free)
        self.kv_page_bytes.set(page_bytes)

    def step(self, batch_size: int, seconds: float) -> None:
        self.batch_size.observe(batch_size)
        self.step_seconds.observe(seconds)
