"""Which prompt gets a step's budget: those one step's budget takes whole first, oldest first,
so a returning turn's first token does not wait out a new conversation's long prefill nor a
stream of shorter turns; and a long prompt passed over too often goes first, so a stream of
short ones cannot starve it.

Tiny transformers model (CPU, float32, random weights), the scheduler driven by hand (as in
test_batching_share.py): every reply must still equal the session's greedy reply alone.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from test_batching import _build, _greedy_alone, _job, _prompts
from test_batching_share import _close, _drive, _first_turns, _next_prompts, _reply, _restored

from kvtier.errors import ConfigError
from kvtier.server.batch.batching import BatchScheduler
from kvtier.server.batch.promptorder import PASSED_OVER_STEPS
from kvtier.server.batch.turn import Turn
from kvtier.server.config import ServerConfig

BUDGET = 16  # prompt tokens in a step that decodes (`decoding_prompt_tokens`)


def test_a_returning_turn_goes_before_a_long_prefill(tmp_path: Path) -> None:
    ref, served = _build("llama"), _build("llama")
    firsts = _prompts(40, [130, 140])  # d decodes throughout; r returns mid-prefill of n
    sched, backend, replies = _first_turns(
        served, tmp_path, [_job("d", firsts[0], 8), _job("r", firsts[1], 8)]
    )
    loop = asyncio.new_event_loop()
    try:
        d_next, r_next = _next_prompts(firsts, replies, 41)
        long_prompt = _prompts(42, [400])[0]  # 25 steps of BUDGET tokens
        d = _restored(sched, loop, _job("d", d_next, 48))
        n = _restored(sched, loop, _job("n", long_prompt, 4), check=False)
        r = _restored(sched, loop, _job("r", r_next, 4))
        seen: dict[str, int] = {}
        worst = {"passed_over": 0}

        def hook(step: int) -> None:
            if step == 0:
                sched.waiting.extend([d, n])
            if step == 4:  # n prefills, d decodes: the budget is BUDGET tokens a step
                sched.waiting.append(r)
            if r.first and "r" not in seen:
                seen["r"] = step
                seen["n_fed"] = n.fed
            worst["passed_over"] = max(worst["passed_over"], n.passed_over)

        _drive(sched, hook)
        # r's uncached prompt (its first reply and 12 new tokens) fits in two steps' budget;
        # oldest first it would have waited until n's 400 tokens were in (25 steps)
        assert r.cached >= len(firsts[1])
        assert seen["r"] - 4 <= 4, f"r's first token came {seen['r'] - 4} steps after it queued"
        assert seen["n_fed"] < len(long_prompt), "n was still prefilling when r answered"
        assert worst["passed_over"] <= PASSED_OVER_STEPS
        for p, s, k in ((d_next, d, 48), (long_prompt, n, 4), (r_next, r, 4)):
            assert _reply(served, s) == _greedy_alone(ref, p, k)
        assert sched.pool.num_free == sched.pool.num_pages
    finally:
        _close(sched, backend, loop)


def test_a_prompt_passed_over_too_often_goes_first(tmp_path: Path) -> None:
    served = _build("llama")
    sched, backend, _ = _first_turns(served, tmp_path, [])
    loop = asyncio.new_event_loop()
    try:
        long = _restored(sched, loop, _job("long", _prompts(43, [300])[0], 4), check=False)
        short = _restored(sched, loop, _job("short", _prompts(44, [20])[0], 4), check=False)
        order = sorted([long, short], key=sched.prompts.order)
        assert order == [short, long]
        long.passed_over = PASSED_OVER_STEPS
        assert sorted([long, short], key=sched.prompts.order) == [long, short]
        # short ones (at most BUDGET tokens left) oldest first, whatever their length
        older = _restored(sched, loop, _job("older", _prompts(45, [15])[0], 4), check=False)
        newer = _restored(sched, loop, _job("newer", _prompts(46, [3])[0], 4), check=False)
        older.admitted, newer.admitted = 1.0, 2.0
        assert sorted([newer, older], key=sched.prompts.order) == [older, newer]
        sched.prompts.shortest_first = True  # `prompt_order` "shortest"
        assert sorted([older, newer], key=sched.prompts.order) == [newer, older]
    finally:
        _close(sched, backend, loop)


def _decoder_prompt_shorts(
    sched: BatchScheduler,
    loop: asyncio.AbstractEventLoop,
    seed: int,
    length: int,
    shorts: list[int],
) -> tuple[Turn, list[int], Turn, list[Turn]]:
    """New sessions to queue by hand: "d" (20 prompt tokens, 48 to decode), a `length`-token
    prompt and its turn (2 tokens), and one-token turns of the `shorts` lengths."""
    d = _restored(sched, loop, _job("d", _prompts(seed, [20])[0], 48), check=False)
    prompt = _prompts(seed + 1, [length])[0]
    turn = _restored(sched, loop, _job("p", prompt, 2), check=False)
    rest = [
        _restored(sched, loop, _job(f"s{i}", p, 1), check=False)
        for i, p in enumerate(_prompts(seed + 2, shorts))
    ]
    return d, prompt, turn, rest


def test_a_long_prompt_under_a_stream_of_short_ones_gets_half_the_budget(tmp_path: Path) -> None:
    ref, served = _build("llama"), _build("llama")
    sched, backend, _ = _first_turns(served, tmp_path, [])
    loop = asyncio.new_event_loop()
    try:
        # d decodes throughout, so every step has BUDGET prompt tokens; two 12-token prompts
        # arrive every step from step 2 on (more than the budget), and n's 160 tokens wait
        d, long_prompt, n, shorts = _decoder_prompt_shorts(sched, loop, 50, 160, [12] * 60)
        seen: dict[str, int] = {}

        def hook(step: int) -> None:
            if step == 0:
                sched.waiting.extend([d, n])
            if 2 <= step < 32:
                sched.waiting.extend(shorts[2 * (step - 2) : 2 * (step - 1)])
            if n.first and "n" not in seen:
                seen["n"] = step

        _drive(sched, hook)
        # passed over 8 steps, then half of each step's budget: 160 tokens in about 8 + 20 steps
        # (a chunk every 9th step, as when the promotion lasted one chunk, would take 90)
        assert seen["n"] <= 2 + PASSED_OVER_STEPS + 160 // (BUDGET // 2) + 4, seen
        assert _reply(served, n) == _greedy_alone(ref, long_prompt, 2)
        assert _reply(served, shorts[-1]) == _greedy_alone(ref, shorts[-1].job.prompt_ids, 1)
        assert sched.pool.num_free == sched.pool.num_pages
    finally:
        _close(sched, backend, loop)


def _stream_of_short_turns(tmp_path: Path, shortest_first: bool) -> int:
    """Steps from queueing to the first token of a 15-token prompt queued while six 3-token
    prompts arrive every step (the whole budget) and one session decodes throughout."""
    ref, served = _build("llama"), _build("llama")
    order = "shortest" if shortest_first else "arrival"
    sched, backend, _ = _first_turns(served, tmp_path, [], prompt_order=order)
    assert sched.prompts.shortest_first == shortest_first
    loop = asyncio.new_event_loop()
    try:
        d, middle, m, shorts = _decoder_prompt_shorts(sched, loop, 60, 15, [3] * 96)
        seen: dict[str, int] = {}

        def hook(step: int) -> None:
            if step == 0:
                sched.waiting.append(d)
            if 1 <= step <= 16:
                for s in shorts[6 * (step - 1) : 6 * step]:
                    s.admitted = float(step)
                    sched.waiting.append(s)
            if step == 2:
                m.admitted = 2.0
                sched.waiting.append(m)
            if m.first and "m" not in seen:
                seen["m"] = step - 2

        _drive(sched, hook)
        assert _reply(served, m) == _greedy_alone(ref, middle, 2)
        assert sched.pool.num_free == sched.pool.num_pages
        return seen["m"]
    finally:
        _close(sched, backend, loop)


def test_a_returning_turn_is_not_passed_by_shorter_ones(tmp_path: Path) -> None:
    # Admission leaves room in the budget for the prompts admitted before (m's 15 of 16), so
    # what changes is who is cut when a later short one is admitted into the last token of
    # room: oldest first, the newcomer; shortest first, m, whose first token then waits a step.
    oldest = _stream_of_short_turns(tmp_path / "oldest", shortest_first=False)
    shortest = _stream_of_short_turns(tmp_path / "shortest", shortest_first=True)
    assert oldest <= 4, oldest
    assert shortest > oldest, (oldest, shortest)


def test_an_unknown_prompt_order_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="prompt_order: 'fifo' is unknown"):
        ServerConfig.load(flags={"prompt_order": "fifo"}, env={})
    assert ServerConfig.load(flags={}, env={}).prompt_order == "arrival"
