"""The model runner of the batch: one forward, its sampling, and its tokens handed to the requests.

`StepRunner` runs what the scheduler (kvtier/server/batch/batching.py) chose (`_launch`: the forward,
then sampling on the host, or for an all-greedy step on the device only) and takes the tokens
(`_complete`: the text each adds to its reply, and whether the reply is done). It decides
nothing about what runs, and ends no turn: `step` returns a `StepOutput`, what the steps whose
tokens it took gave each turn (its text, its finish reason or its fault), and the scheduler
ends the turns (their events, their pages, their commits). With overlapped steps
(`overlap_steps`, kvtier.server.batch.lookahead) the tokens of a step are taken after the next step
was launched, so the GPU never waits for this thread; a reply that ended meanwhile drops the
row it had in the running step (`_unplace`), and its turn takes nothing more from that step.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvtier.paged import BatchRunner, Feed, PagePool, SeqInput
from kvtier.server.backend import Backend
from kvtier.server.batch.lookahead import Ticket, TokenReadback
from kvtier.server.batch.turn import Turn
from kvtier.server.decoding.logitproc import NoTokenAllowed, process, record
from kvtier.server.decoding.sampling import is_greedy, sample_rows
from kvtier.server.devices.model import ServedModel

log = logging.getLogger("kvtier.server")


@dataclass(eq=False)
class _Pending:
    """A launched step whose tokens the host has not taken yet."""

    items: list[tuple[Turn, Sequence[int]]]
    start: float
    # the sequences due a token: (sequence, its row of the sampled logits, the index of its
    # placeholder in `tokens` when the token stayed on the device for the next step, or None)
    due: list[tuple[Turn, int, int | None]] = field(default_factory=list)
    sampled: list[int] = field(default_factory=list)  # tokens sampled on the host, `due` order
    # greedy tokens still on their way to the host (overlapped), with the rows that the host
    # samples once they are read (a grammar, penalties, logprobs: `kvtier.server.decoding.logitproc`)
    ticket: Ticket | None = None


# A step with at least this many prompt tokens times a prefill for the cost model (shorter ones
# are bound by launching kernels and say nothing about recomputing a long prefix).
PREFILL_SAMPLE_TOKENS = 512


@dataclass(eq=False)
class TurnOutput:
    """What one step gave one turn: the text its token added (with the logprobs of the tokens
    that text completes, when asked: `kvtier.server.decoding.logitproc`), its first token's
    time, and whether its reply ended (`reason`) or it failed. The scheduler streams the text
    (a `Delta`) when there is any, or logprobs."""

    turn: Turn
    text: str = ""
    logprobs: list[Any] | None = None
    reason: str | None = None  # finished: "stop", "length" or "cancelled"
    flush: bool = False  # the reply's held-back text goes out with its end
    fault: BaseException | None = None  # it failed (its row of the step, or its text)
    ttft: float | None = None  # its first token, this many s after it was admitted

    @property
    def streams(self) -> bool:
        """Whether it has something for the client: text, or logprobs (of text held back)."""
        return bool(self.text) or self.logprobs is not None


@dataclass(eq=False)
class StepFault:
    """A forward that failed: its error and the turns it ran (none of them took a token)."""

    exc: BaseException
    items: list[tuple[Turn, Sequence[int]]]


@dataclass(eq=False)
class StepOutput:
    """What the steps whose tokens one call took gave their turns, in the order they took
    them (a turn appears once per step); `failed`: the step launched by that call failed."""

    turns: list[TurnOutput] = field(default_factory=list)
    failed: StepFault | None = None
    ended: set[Turn] = field(default_factory=set)  # it takes nothing more from these steps

    def took(self, s: Turn) -> TurnOutput:
        """`s`'s output of the step whose token it takes now."""
        o = TurnOutput(s)
        self.turns.append(o)
        return o

    def finish(self, o: TurnOutput, reason: str, flush: bool = False) -> None:
        o.reason, o.flush = reason, flush
        self.ended.add(o.turn)

    def fail(self, s: Turn, exc: BaseException) -> None:
        self.turns.append(TurnOutput(s, fault=exc))
        self.ended.add(s)


class StepRunner:
    """Runs the scheduler's steps on `runner` (kvtier.paged.BatchRunner: inputs, CUDA graphs)."""

    def __init__(
        self,
        runner: BatchRunner,
        served: ServedModel,
        backend: Backend,
        *,
        max_batch: int,
        overlap_steps: bool,
        metrics: Any = None,
    ) -> None:
        self.runner = runner
        self.served = served
        self.backend = backend
        self.metrics = metrics
        # an all-greedy step's tokens stay on the device for the next step (kvtier.server.batch.lookahead)
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

    def step(self, items: list[tuple[Turn, Sequence[int]]]) -> StepOutput:
        """Launch a step; then take the tokens of the step before it (overlapped: the GPU runs
        this one meanwhile), then this step's own unless they may wait (`kvtier.server.
        lookahead`). What they gave each turn comes back; a forward that failed comes back as
        `failed`, and the step before it stays in flight (its tokens are taken next)."""
        out = StepOutput()
        before, self.pending = self.pending, None
        launched = self._launch(items, out)
        if launched is None:
            self.pending = before
            return out
        if before is not None:
            self._complete(before, out)
        if launched.ticket is not None:
            self.pending = launched
        else:
            self._complete(launched, out)
        return out

    def drain(self) -> StepOutput:
        """Take the tokens of the step in flight, if any (before anything that needs every
        sequence's tokens on the host: preemption, cancellation, a device failover)."""
        out = StepOutput()
        before, self.pending = self.pending, None
        if before is not None:
            self._complete(before, out)
        return out

    def _launch(self, items: list[tuple[Turn, Sequence[int]]], out: StepOutput) -> _Pending | None:
        """Run the forward of `items` and sample: on the host (synchronously), or for an
        all-greedy step on the device only, each due sequence getting a placeholder token that
        the next step feeds from the device. None: the forward failed (`out.failed`)."""
        start = time.perf_counter()
        batch = [SeqInput(s.paged, toks) for s, toks in items]  # type: ignore[arg-type]
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
            out.failed = StepFault(exc, items)
            return None
        for s, _ in items:
            s.feed = None  # fed now (its placeholder's value arrives with the step before)
        p = _Pending(items, start)
        # a token is due where the step's table holds all the turn's tokens now
        due = [(k, s) for k, (s, _) in enumerate(items) if batch[k].seq.length == len(s.tokens)]
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
            p.sampled = self._sample_host(chosen, [s for _, s in due], out)
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

    def _sample_host(self, logits: torch.Tensor, seqs: list[Turn], out: StepOutput) -> list[int]:
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
            self._row_failed(seqs[j], exc, out)
        return sampled

    @staticmethod
    def _row_failed(s: Turn, exc: BaseException, out: StepOutput) -> None:
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
        out.fail(s, exc)

    def _complete(self, p: _Pending, out: StepOutput) -> None:
        """The host side of a launched step: each due turn's token, the text it adds, and
        whether its reply ended, into `out`."""
        if p.ticket is not None:
            host = p.ticket.wait()
            sampled = [host[row] for _, row, _ in p.due]
            if p.ticket.kept is not None:  # sampled on the host, off the device's stream
                rows = [j for j, (s, _, _) in enumerate(p.due) if s.decoding is not None]
                drawn = self._sample_host(p.ticket.kept, [p.due[j][0] for j in rows], out)
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
            if s.gone or s in out.ended:
                continue  # it ended before this step's tokens arrived
            if placed is not None:
                s.tokens[placed] = token
                if len(s.tokens) == placed + 1:
                    s.feed = None  # not fed yet (no step ran since): the host has it now
            o = out.took(s)
            if not s.first:
                s.first = True
                o.ttft = now - s.admitted
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
                out.finish(o, "length", flush=True)
                continue
            s.trace.token(now)
            try:
                delta = s.reply.add(token)  # detokenizing and the stop search: this row's own
            except Exception as exc:
                self._unplace(s, placed)
                self._row_failed(s, exc, out)
                continue
            self._take(o, token, delta, placed, out)
        if self.metrics is not None and hasattr(self.metrics, "step"):
            self.metrics.step(len(p.items), took)

    def _take(
        self, o: TurnOutput, token: int, delta: str, placed: int | None, out: StepOutput
    ) -> None:
        """A sampled token, `delta` the text it adds to the reply: its text to stream, then the
        reply's end or the token queued to be fed (`placed`: it is in the turn's tokens at that
        index already, and may be fed already)."""
        s = o.turn
        reply = s.reply
        d = s.decoding
        ends = reply.stopped or reply.eos or len(reply.ids) >= s.job.max_tokens
        if d is not None and d.logprobs is not None and (delta or ends):
            o.text, o.logprobs = delta, d.take_pending()
        else:
            o.text = delta
        if reply.stopped:
            self._unplace(s, placed)
            out.finish(o, "stop")
        elif reply.eos or len(reply.ids) >= s.job.max_tokens or s.stream.cancelled.is_set():
            self._unplace(s, placed)
            if s.stream.cancelled.is_set():
                out.finish(o, "cancelled")
            else:
                out.finish(o, "stop" if reply.eos else "length", flush=True)
        elif placed is None:
            s.tokens.append(token)

    def _unplace(self, s: Turn, placed: int | None) -> None:
        """The reply ended at the token placed at `s.tokens[placed]`: as if it had never been
        queued, drop it (and a placeholder after it), and the K/V a running step wrote for it."""
        if placed is None:
            return
        del s.tokens[placed:]
        s.feed = None
        if s.paged is not None and s.paged.length > placed:
            s.paged.length = placed
