"""The model runner of the batch: one forward, its sampling, and its tokens handed to the requests.

`StepRunner` runs what the scheduler (kvtier/server/batching.py) chose (`_launch`: the forward,
then sampling on the host, or for an all-greedy step on the device only) and takes the tokens
(`_complete`: stream the text, end the replies that are done). It decides nothing about what
runs: how a turn ends (its events, its commit) is the scheduler's, reached through `TurnEnds`. With overlapped steps (`overlap_steps`, kvtier.server.lookahead) the
tokens of a step are taken after the next step was launched, so the GPU never waits for this
thread; a reply that ended meanwhile drops the row it had in the running step (`_unplace`).
Everything else (admission, restores, pages, the end of a turn) stays in batching.py.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from kvtier.paged import BatchRunner, Feed, PagedSequence, PagePool, SeqInput
from kvtier.server.backend import Backend, Restored
from kvtier.server.jobs import Delta, Job, Stream
from kvtier.server.logitproc import Decoding, NoTokenAllowed, process, record
from kvtier.server.lookahead import Ticket, TokenReadback
from kvtier.server.model import ServedModel
from kvtier.server.sampling import ReplyText, is_greedy, sample_rows
from kvtier.server.turntrace import TurnTrace

log = logging.getLogger("kvtier.server")


@dataclass(eq=False)
class _Seq:
    """One request inside the scheduler."""

    job: Job
    stream: Stream
    admitted: float
    done: concurrent.futures.Future[None]
    reply: ReplyText
    gen: torch.Generator | None
    # prompt + sampled tokens; the last sampled one is fed in the next step. An array: no
    # Python object per id, so the cyclic collector never walks them (a list of a running
    # turn's 3,000 ids was walked id by id by every collection that reached it)
    tokens: array[int]
    restored: Restored | None = None
    cached: int = 0  # leading tokens whose K/V the session's Cache holds
    paged: PagedSequence | None = None  # its pages while running, None while waiting
    first: bool = False  # the first token's logits arrived (TTFT observed)
    trace: TurnTrace = field(default_factory=TurnTrace)  # where the time to its first token went
    # content keys of the full pages of the cached prefix, for (cached, page size)
    keys: tuple[int, int, list[bytes]] | None = None
    # its last token is a placeholder whose value is on the device: (tensor, row)
    feed: tuple[torch.Tensor, int] | None = None
    gone: bool = False  # it left the scheduler (finished or failed)
    # paged L1 (`paged_l1`): its session's parked pages that hold its cached prefix (a
    # `kvtier.server.parking.Parked`), and the K/V [layer, k|v, token, head, dim] of its first `cached`
    # tokens while it waits after a preemption
    held: Any = None
    holds_l1: bool = (
        False  # restored into L1, and L1 not yet released (see `RestoreWorkers.release_l1`)
    )
    spilled: torch.Tensor | None = None
    # paged L1: the copies of its staged prefix into its pages (a transfer Handle) while they
    # run; it joins no step until they are done
    loading: Any = None
    # steps in a row whose prompt budget ran out before its turn (`kvtier.server.promptorder`)
    passed_over: int = 0
    # its logits processing (penalties, grammar, logprobs), None when it asks for none
    decoding: Decoding | None = None

    @property
    def fed(self) -> int:
        """Tokens whose K/V exists (in pages while running, in the Cache while waiting)."""
        return self.paged.length if self.paged is not None else self.cached

    @property
    def unfed(self) -> int:
        """Tokens still to feed: 1 while it decodes, more while its prompt prefills."""
        return len(self.tokens) - self.fed


@dataclass(eq=False)
class _Pending:
    """A launched step whose tokens the host has not taken yet."""

    items: list[tuple[_Seq, Sequence[int]]]
    start: float
    # the sequences due a token: (sequence, its row of the sampled logits, the index of its
    # placeholder in `tokens` when the token stayed on the device for the next step, or None)
    due: list[tuple[_Seq, int, int | None]] = field(default_factory=list)
    sampled: list[int] = field(default_factory=list)  # tokens sampled on the host, `due` order
    # greedy tokens still on their way to the host (overlapped), with the rows that the host
    # samples once they are read (a grammar, penalties, logprobs: `kvtier.server.logitproc`)
    ticket: Ticket | None = None


# A step with at least this many prompt tokens times a prefill for the cost model (shorter ones
# are bound by launching kernels and say nothing about recomputing a long prefix).
PREFILL_SAMPLE_TOKENS = 512


class TurnEnds(Protocol):
    """What the step runner needs of its scheduler: how a turn fails, ends and streams."""

    def fail(self, s: _Seq, exc: BaseException) -> None: ...
    def finish(self, s: _Seq, reason: str, flush: bool = False) -> None: ...
    def post(self, s: _Seq, event: Any) -> None: ...
    def observe_ttft(self, s: _Seq, seconds: float) -> None: ...
    def lost_in_step(self, exc: BaseException, items: list[Any]) -> bool: ...


class StepRunner:
    """Runs the scheduler's steps on `runner` (kvtier.paged.BatchRunner: inputs, CUDA graphs)."""

    def __init__(
        self,
        runner: BatchRunner,
        served: ServedModel,
        backend: Backend,
        ends: TurnEnds,
        *,
        max_batch: int,
        overlap_steps: bool,
        metrics: Any = None,
    ) -> None:
        self.runner = runner
        self.served = served
        self.backend = backend
        self.ends = ends
        self.metrics = metrics
        # an all-greedy step's tokens stay on the device for the next step (kvtier.server.lookahead)
        self.overlap_steps = overlap_steps
        self.readback = TokenReadback(runner.pool.device, max_batch)
        self.pending: _Pending | None = None  # the step in flight whose tokens are not taken yet
        self._last_done = 0.0  # when the last step's tokens were taken

    @property
    def pool(self) -> PagePool:
        return self.runner.pool

    def replace_runner(self, runner: BatchRunner) -> None:
        """A new runner (a device failover's new pool); no step may be in flight."""
        assert self.pending is None
        self.runner = runner

    # ---- the step -----------------------------------------------------------------------------

    def step(self, items: list[tuple[_Seq, Sequence[int]]]) -> None:
        """Launch a step; then take the tokens of the step before it (overlapped: the GPU runs
        this one meanwhile), then this step's own unless they may wait (`kvtier.server.
        lookahead`)."""
        before, self.pending = self.pending, None
        launched = self._launch(items)
        if before is not None:
            self._complete(before)
        if launched is not None:
            if launched.ticket is not None:
                self.pending = launched
            else:
                self._complete(launched)

    def drain(self) -> None:
        """Take the tokens of the step in flight, if any (before anything that needs every
        sequence's tokens on the host: preemption, cancellation, a device failover)."""
        before, self.pending = self.pending, None
        if before is not None:
            self._complete(before)

    def _launch(self, items: list[tuple[_Seq, Sequence[int]]]) -> _Pending | None:
        """Run the forward of `items` and sample: on the host (synchronously), or for an
        all-greedy step on the device only, each due sequence getting a placeholder token that
        the next step feeds from the device. None: the forward failed (handled here)."""
        start = time.perf_counter()
        batch = [SeqInput(s.paged, toks) for s, toks in items]  # type: ignore[arg-type]
        if self.pool.quantized:
            for s, _ in items:
                s.stream.degraded_kv = "int8"  # the response and metrics say so
        fed = [(k, s.feed) for k, (s, _) in enumerate(items) if s.feed is not None]
        feed = None
        if fed:
            feed = Feed([k for k, _ in fed], fed[0][1][0], [f[1] for _, f in fed])
        prompt = sum(len(t) for _, t in items if len(t) > 1)
        timed = prompt >= PREFILL_SAMPLE_TOKENS
        try:
            logits = self.runner.step(batch, feed)
            if timed:
                # how a recompute runs now: the cost model learns it (a device sync first, as
                # the forward is asynchronous; sampling below waits for it anyway)
                if self.pool.device.type == "cuda":
                    torch.cuda.synchronize(self.pool.device)
                self.backend.observe_prefill(prompt, time.perf_counter() - start)
        except BaseException as exc:
            if self.ends.lost_in_step(exc, items):
                return None  # a device was lost: its sequences wait to run on the survivors
            log.exception("batched forward failed (%d sequences)", len(items))
            for s, _ in items:
                self.ends.fail(s, exc)
            return None
        for s, _ in items:
            s.feed = None  # fed now (its placeholder's value arrives with the step before)
        p = _Pending(items, start)
        due = [(k, s) for k, (s, _) in enumerate(items) if s.fed == len(s.tokens)]
        if not due:
            return p
        # Overlapped when every row is greedy but those with a Decoding (a grammar, penalties,
        # logprobs): their logits are copied out now and sampled on the host when the step's
        # tokens are read. They sit the next step out (their token is not known when it is
        # launched) and join the one after: the other rows keep their pace (bench/grammar_step.py).
        ahead = (
            self.overlap_steps
            and not timed
            and self.served.devices is None
            and all(is_greedy(s.job.temperature) or s.decoding is not None for _, s in due)
            and any(s.decoding is None for _, s in due)
        )
        if ahead or len(due) == len(items):
            # every row: an index of rows would go to the device by a copy that waits for it
            chosen = logits[: len(items)]
        else:
            chosen = logits[[k for k, _ in due]]
        allowed = self.served.allowed
        if allowed is not None:  # one call (each torch call gives the GIL up and back)
            chosen = torch.where(allowed, chosen, float("-inf"))
        if not ahead:
            p.sampled = self._sample_host(chosen, [s for _, s in due])
            p.due = [(s, j, None) for j, (_, s) in enumerate(due)]
            return p
        # the rows the host samples: copied to the host with the tokens, before the next step
        # writes the logits again (argmax in the model's dtype: exact)
        later = [k for k, s in due if s.decoding is not None]
        tokens, p.ticket = self.readback.start(chosen, keep=later)
        for k, s in due:
            if s.decoding is not None:
                p.due.append((s, k, None))  # sampled on the host once the ticket is read
                continue
            if s.job.max_tokens <= 0 or len(s.reply.ids) + 1 >= s.job.max_tokens:
                p.due.append((s, k, None))  # its last token: nothing more to feed
                continue
            p.due.append((s, k, len(s.tokens)))
            s.tokens.append(0)  # a placeholder: the next step feeds the token from the device
            s.feed = (tokens, k)
        return p

    def _sample_host(self, logits: torch.Tensor, seqs: list[_Seq]) -> list[int]:
        """One token for each row of `logits` (`seqs` in order), drawn on the host after the
        rows' penalties and grammar masks. A row whose processing, draw or grammar raises (or
        whose grammar allows no token) fails its own turn, and only its own: the other rows get
        their tokens (a failed turn's token is never taken: the turn is gone)."""
        decodings = [s.decoding for s in seqs]
        processed = any(d is not None for d in decodings)
        faults: dict[int, BaseException] = {}
        if processed:
            logits = logits.float().clone()  # the rows' penalties and masks go on a copy
            process(logits, decodings, faults)
        sampled = sample_rows(
            logits.float(),
            [s.job.temperature for s in seqs],
            [s.job.top_p for s in seqs],
            [s.gen for s in seqs],
            faults,
        )
        if processed:
            record(logits, decodings, sampled, faults)
        for j, exc in faults.items():
            self._row_failed(seqs[j], exc)
        return sampled

    def _row_failed(self, s: _Seq, exc: BaseException) -> None:
        """One row's fault: its turn fails, the step's other rows go on."""
        if not isinstance(exc, NoTokenAllowed):  # a request's own error, not a fault
            log.error(
                "session %s: its row of the step failed (%s: %s); that turn fails, the "
                "others go on",
                s.job.session_id[:64],
                type(exc).__name__,
                exc,
                exc_info=exc,
            )
        self.ends.fail(s, exc)

    def _complete(self, p: _Pending) -> None:
        """The host side of a launched step: its tokens streamed, finished turns ended."""
        if p.ticket is not None:
            host = p.ticket.wait()
            sampled = [host[row] for _, row, _ in p.due]
            if p.ticket.kept is not None:  # sampled on the host, off the device's stream
                rows = [j for j, (s, _, _) in enumerate(p.due) if s.decoding is not None]
                drawn = self._sample_host(p.ticket.kept, [p.due[j][0] for j in rows])
                for j, token in zip(rows, drawn, strict=True):
                    sampled[j] = token
        else:
            sampled = p.sampled
        now = time.perf_counter()
        took = now - max(p.start, self._last_done)  # overlapped steps: the time between them
        self._last_done = now
        for s, _ in p.items:
            if not s.first and not s.gone:
                s.trace.step(took)
        for (s, _, placed), token in zip(p.due, sampled, strict=True):
            if s.gone:
                continue  # it ended before this step's tokens arrived
            if placed is not None:
                s.tokens[placed] = token
                if len(s.tokens) == placed + 1:
                    s.feed = None  # not fed yet (no step ran since): the host has it now
            if not s.first:
                s.first = True
                self.ends.observe_ttft(s, now - s.admitted)
                assert s.restored is not None
                s.trace.log_first(
                    s.job.session_id,
                    s.admitted,
                    now,
                    s.restored.source,
                    s.cached,
                    len(s.job.prompt_ids),
                    self.pool.device,
                )
            if s.job.max_tokens <= 0:
                self._unplace(s, placed)
                self.ends.finish(s, "length", flush=True)
                continue
            s.stream.clock.token(now)
            try:
                delta = s.reply.add(token)  # detokenizing and the stop search: this row's own
            except Exception as exc:
                self._unplace(s, placed)
                self._row_failed(s, exc)
                continue
            self._take(s, token, delta, placed)
        if self.metrics is not None and hasattr(self.metrics, "step"):
            self.metrics.step(len(p.items), took)

    def _take(self, s: _Seq, token: int, delta: str, placed: int | None = None) -> None:
        """A sampled token, `delta` the text it adds to the reply: stream it, then end the reply
        or queue the token to be fed (`placed`: it is in `s.tokens` at that index already, and
        may be fed already)."""
        reply = s.reply
        d = s.decoding
        ends = reply.stopped or reply.eos or len(reply.ids) >= s.job.max_tokens
        if d is not None and d.logprobs is not None and (delta or ends):
            self.ends.post(s, Delta(delta, d.take_pending()))
        elif delta:
            self.ends.post(s, Delta(delta))
        if reply.stopped:
            self._unplace(s, placed)
            self.ends.finish(s, "stop")
        elif reply.eos or len(reply.ids) >= s.job.max_tokens or s.stream.cancelled.is_set():
            self._unplace(s, placed)
            if s.stream.cancelled.is_set():
                self.ends.finish(s, "cancelled")
            else:
                self.ends.finish(s, "stop" if reply.eos else "length", flush=True)
        elif placed is None:
            s.tokens.append(token)

    def _unplace(self, s: _Seq, placed: int | None) -> None:
        """The reply ended at the token placed at `s.tokens[placed]`: as if it had never been
        queued, drop it (and a placeholder after it), and the K/V a running step wrote for it."""
        if placed is None:
            return
        del s.tokens[placed:]
        s.feed = None
        if s.paged is not None and s.paged.length > placed:
            s.paged.length = placed
