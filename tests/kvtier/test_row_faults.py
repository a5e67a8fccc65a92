"""One request's fault in the batch's per-row work fails that request alone: the other turns of
the same steps go on and get exactly the replies they get alone (CPU, random weights)."""

from __future__ import annotations

import asyncio
import math
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from test_batching import _build, _config, _greedy_alone, _job, _prompts

from kvtier.server.backend import RecomputeBackend
from kvtier.server.batch.batching import BatchScheduler
from kvtier.server.batch.jobs import Delta, Failed, Finished, Job, Stream
from kvtier.server.decoding.logitproc import LOGPROB_FLOOR, Decoding, record
from kvtier.server.decoding.sampling import NothingToDraw, make_generator, sample_rows

xgrammar = pytest.importorskip("xgrammar")


class Injected(RuntimeError):
    """The fault planted in one row."""


class FaultyMatcher:
    """A real xgrammar matcher for `{"type": "object"}` whose `where` method raises once the
    reply has `after` tokens: the planted fault of one row."""

    def __init__(self, real: Any, where: str, after: int) -> None:
        self.real, self.where, self.after, self.tokens = real, where, after, 0

    def is_terminated(self) -> bool:
        return bool(self.real.is_terminated())

    def fill_next_token_bitmask(self, bitmask: Any, index: int) -> None:
        if self.where == "mask" and self.tokens >= self.after:
            raise Injected("mask")
        self.real.fill_next_token_bitmask(bitmask, index)

    def accept_token(self, token: int) -> bool:
        if self.where == "accept" and self.tokens >= self.after:
            raise Injected("accept")
        self.tokens += 1
        return bool(self.real.accept_token(token))


async def _collect(sched: BatchScheduler, job: Job) -> tuple[str, Any]:
    stream = Stream(asyncio.get_running_loop())
    done = asyncio.wrap_future(sched.submit(job, stream, time.perf_counter()))
    text, end = "", None
    try:
        async for event in stream.events():
            if isinstance(event, Delta):
                text += event.text
            elif isinstance(event, Finished):
                end = event
    except Injected as exc:  # the stream raises its turn's failure
        end = Failed(exc)
    await done
    return text, end


@pytest.mark.parametrize("where", ["mask", "accept"])
def test_a_fault_in_one_row_of_sixteen_fails_that_turn_alone(where: str, tmp_path: Path) -> None:
    served = _build("llama")
    ref = _build("llama")
    from kvtier.server.decoding.grammar import GrammarSpec
    from kvtier.server.http.completions import grammar_book

    book = grammar_book(served)
    compiled = book.compile(GrammarSpec("json"))
    backend = RecomputeBackend(served.model)
    config = _config(tmp_path, max_concurrency=16, batch_tokens=512)
    sched = BatchScheduler(served, backend, config)
    prompts = _prompts(7, [9 + 5 * i for i in range(16)])
    faulty = 5

    def job(i: int) -> Job:
        if i != faulty:
            return _job(f"s{i}", prompts[i], 24)
        matcher = FaultyMatcher(book.matcher(compiled), where, after=3)
        return _job(f"s{i}", prompts[i], 24, grammar=lambda: matcher)

    async def main() -> list[tuple[str, Any]]:
        return list(await asyncio.gather(*(_collect(sched, job(i)) for i in range(16))))

    try:
        results = asyncio.run(asyncio.wait_for(main(), 120))
        # every turn ran in the same steps as the faulty one: 16 rows at once
        assert sched.max_batch >= 16
    finally:
        sched.close()
        backend.close()
    text, end = results[faulty]
    assert isinstance(end, Failed) and isinstance(end.error, Injected), end
    for i, (text, end) in enumerate(results):
        if i == faulty:
            continue
        assert isinstance(end, Finished), (i, end)
        assert text == _greedy_alone(ref, prompts[i], 24), i
    assert sched.pool.num_free == sched.pool.num_pages  # the failed turn's pages came back


def test_a_row_with_nothing_to_draw_is_its_own_fault() -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    logits[1] = float("nan")
    temps, top_ps = [0.8, 0.8, 0.0], [1.0, 1.0, 1.0]
    gens = [make_generator(t, 3) for t in temps]
    faults: dict[int, BaseException] = {}
    tokens = sample_rows(logits, temps, top_ps, gens, faults)
    assert list(faults) == [1] and isinstance(faults[1], NothingToDraw)
    alone = sample_rows(logits[[0]], [0.8], [1.0], [make_generator(0.8, 3)])
    assert tokens[0] == alone[0] and tokens[2] == int(logits[2].argmax())
    with pytest.raises(NothingToDraw):  # without `faults` (one request's own path): raised
        sample_rows(logits[[1]], [0.8], [1.0], [make_generator(0.8, 3)])


def test_a_tiny_temperature_samples_as_greedy() -> None:
    from kvtier.server.http.schema import ChatRequest

    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": 1e-40}
    assert ChatRequest.model_validate(body).temperature == 0.0
    # a Job made in process with such a temperature draws greedily too, rather than NaN
    logits = torch.randn(2, 40, generator=torch.Generator().manual_seed(2))
    faults: dict[int, BaseException] = {}
    tokens = sample_rows(logits, [1e-40, 1e-30], [1.0, 1.0], [None, None], faults)
    assert not faults and tokens == logits.argmax(dim=-1).tolist()
    assert make_generator(1e-40, 1) is None


def test_masked_tokens_report_finite_logprobs() -> None:
    """A grammar's mask leaves -inf logits: the reply's logprobs stay finite (JSON has no
    -Infinity): the masked ids are left out of `top`, an impossible chosen id gets a floor."""
    logits = torch.full((1, 10), float("-inf"))
    logits[0, 3], logits[0, 4] = 2.0, 1.0
    d = Decoding(logprobs=5)
    record(logits, [d], [3])
    (lp,) = d.pending
    assert [t for t, _ in lp.top] == [3, 4]
    assert all(math.isfinite(v) for _, v in lp.top) and math.isfinite(lp.logprob)
    d = Decoding(logprobs=2)
    record(logits, [d], [7])  # a forced id the mask forbade
    assert d.pending[0].logprob == LOGPROB_FLOOR
