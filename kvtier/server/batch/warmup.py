"""The start-up warm-up: the paths the first requests take, run once before them.

Through the cache on a throwaway session (a prefill, a store to L3, restores from L3 that
measure it), then the batch scheduler's three kinds of step and its CUDA graphs, then a timed
batched prefill for the cost model. `Engine.warm_up` runs it; the GPU memory plan gets what it
measured (the graphs' bytes) and the start-up phases' peaks.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kvtier.errors import L1BudgetExceeded
from kvtier.server.backend import Backend
from kvtier.server.batch.jobs import WARM_UP_SESSION, WARM_UP_TENANT
from kvtier.server.config import ServerConfig
from kvtier.server.devices.memplan import DeviceMemoryPlan, take_peak
from kvtier.server.devices.model import ServedModel

log = logging.getLogger("kvtier.server")

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


@dataclass(eq=False, kw_only=True)
class WarmUp:
    served: ServedModel
    backend: Backend
    config: ServerConfig
    plan: DeviceMemoryPlan | None  # with_measured(graphs=...) once the graphs are captured
    peaks: dict[str, int]  # the start-up phases' device peaks (with a plan)
    forward: Callable[[torch.Tensor, Any], torch.Tensor]  # the engine's plain forward
    scheduler: Callable[[], Any]  # the batch scheduler, started on first call (None: none)

    def run(
        self, tokens: int = WARM_UP_TOKENS, prefill_tokens: int = WARM_UP_PREFILL_TOKENS
    ) -> DeviceMemoryPlan | None:
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
            return self.plan
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
        return self.plan

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
        sched = self.scheduler()
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
        if sched.graphed:
            started = time.perf_counter()
            device = sched.pool.device
            self._peak("batch_first_steps")
            # the first steps' freed blocks go back first: the empty_cache after the capture
            # returns them too, and counted in `before` alone they made the graphs' figure
            # negative (-878 MiB on an H100 whose first steps prefilled 2,048 tokens)
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()
            before = torch.cuda.memory_reserved(device)
            sizes = sched.capture_graphs()
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
                logits = self.forward(ids[:, pos:end], restored.kv)
                pos = end
            if decode and logits is not None:
                token = torch.argmax(logits).reshape(1, 1).to(ids.device)
                self.forward(token, restored.kv)
        except BaseException:
            self.backend.abort(sid, tenant, session=restored.session)
            raise
        if commit is None:
            self.backend.abort(sid, tenant, session=restored.session)
        else:
            self.backend.commit(sid, tenant, commit, session=restored.session)
