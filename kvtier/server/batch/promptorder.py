"""Which prompts get a batched step's token budget, and how much of it each.

Short prompts (what one decoding step's budget takes whole: a returning turn's 50-200 tokens)
go before long ones (a new conversation's thousands, whose own first token is far off anyway),
so a turn's first token does not queue behind another turn's long prefill. Short ones go oldest
first (`prompt_order` "arrival"): shortest first among them too cut an admitted prompt whenever
a shorter newcomer took the budget first, and that made the slowest first tokens on an H200
(docs/benchmarks-history.md). Shortest first ("shortest") gives a lower mean where turns queue for
slots (the CPU demo). Long ones go shortest left first. A prompt passed over for
`PASSED_OVER_STEPS` steps in a row goes first from then on, with at most half of each step's
budget while others wait, so a stream of short ones cannot starve a long one, nor a long one
hold them all back.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from kvtier.server.batch.turn import Turn

# a prompt that got no chunk in this many steps in a row goes ahead of shorter ones (with half
# the budget) until its prompt is in
PASSED_OVER_STEPS = 8


class PromptOrder:
    """The prompts' order and chunks: `short` tokens or fewer is a short prompt, a chunk is at
    most `prefill_step` tokens, and `shortest_first` orders short ones by length."""

    def __init__(self, short: int, prefill_step: int, shortest_first: bool) -> None:
        self.short = short
        self.prefill_step = prefill_step
        self.shortest_first = shortest_first

    def order(self, s: Turn) -> tuple[bool, bool, float]:
        """The sort key of a prefilling turn: the first gets the budget first."""
        long = s.unfed > self.short
        order = float(s.unfed) if long or self.shortest_first else s.admitted
        return (s.passed_over < PASSED_OVER_STEPS, long, order)

    def chunks(self, prefilling: list[Turn], budget: int) -> list[tuple[Turn, Sequence[int]]]:
        """Each prefilling turn's next prompt chunk within `budget` tokens, in order."""
        prefilling.sort(key=self.order)
        half = max(budget // 2, 1)
        items: list[tuple[Turn, Sequence[int]]] = []
        for s in prefilling:
            if budget <= 0:
                s.passed_over += 1
                continue
            n = min(s.unfed, self.prefill_step, budget)
            if s.passed_over >= PASSED_OVER_STEPS and len(prefilling) > 1:
                n = min(n, half)  # promoted for good; the other half stays with shorter ones
            else:
                s.passed_over = 0
            items.append((s, s.tokens[s.fed : s.fed + n]))
            budget -= n
        return items
