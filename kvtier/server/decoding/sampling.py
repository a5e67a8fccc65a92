"""Token sampling and reply streaming, shared by the per-request worker and the batch scheduler.

`sample` picks one token from one row of logits (greedy, temperature, top-p) with a request's own
`torch.Generator`, so a seeded request draws the same tokens whatever else runs. `ReplyText`
turns the sampled ids into the text deltas a client is streamed: it holds back the characters
that could still become a stop string and an incomplete UTF-8 sequence, and cuts at the first
stop string.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Sequence
from typing import Any

import torch

from kvtier.server.decoding import GREEDY_BELOW


def is_greedy(temperature: float) -> bool:
    return temperature < GREEDY_BELOW


def make_generator(temperature: float, seed: int | None) -> torch.Generator | None:
    """A request's own CPU generator (None for greedy); unseeded requests get a fresh seed."""
    if is_greedy(temperature):
        return None
    gen = torch.Generator()
    gen.manual_seed(seed if seed is not None else int(time.time_ns() % 2**62))
    return gen


def sample(
    logits: torch.Tensor,
    temperature: float,
    top_p: float,
    gen: torch.Generator | None,
    allowed: torch.Tensor | None = None,
) -> int:
    """One token from a `[vocab]` row of logits; `allowed` masks the ids the sampler may pick."""
    if allowed is not None:
        logits = logits.masked_fill(~allowed, float("-inf"))
    return sample_rows(logits.unsqueeze(0), [temperature], [top_p], [gen])[0]


def sample_rows(
    logits: torch.Tensor,
    temperatures: Sequence[float],
    top_ps: Sequence[float],
    gens: Sequence[torch.Generator | None],
    faults: dict[int, BaseException] | None = None,
) -> list[int]:
    """`sample` for every row of `[rows, vocab]` logits (already masked), each with its own
    settings and generator: one argmax and one softmax for all rows, then a draw per row.

    Row `i` gets the token `sample(logits[i], temperatures[i], top_ps[i], gens[i])` gives.
    With `faults` (row -> exception), the rows already in it are not drawn, and a row whose
    draw raises is added to it (its token is then meaningless) instead of raising: one
    request's bad row never costs the others their tokens."""
    tokens: list[int] = logits.argmax(dim=-1).tolist()
    skip = faults if faults is not None else {}
    hot = [i for i, t in enumerate(temperatures) if not is_greedy(t) and i not in skip]
    if not hot:
        return tokens
    temps = torch.tensor([temperatures[i] for i in hot], dtype=logits.dtype, device=logits.device)
    probs = torch.softmax(logits[hot] / temps[:, None], dim=-1).cpu()
    for j, i in enumerate(hot):
        try:
            p = probs[j]
            if top_ps[i] < 1.0:
                sorted_p, order = torch.sort(p, descending=True)
                keep = torch.cumsum(sorted_p, dim=-1) - sorted_p < top_ps[i]
                p = torch.zeros_like(p).scatter(0, order[keep], sorted_p[keep])
            tokens[i] = draw(p, gens[i])
        except Exception as exc:
            if faults is None:
                raise
            faults[i] = exc
    return tokens


class NothingToDraw(ValueError):
    """A row's probabilities have no finite positive mass (NaN or all zero)."""


def draw(probs: torch.Tensor, gen: torch.Generator | None) -> int:
    """One id from a `[vocab]` row of probabilities (not necessarily summing to 1) on the host,
    by its inverse CDF: one uniform from `gen` against the float64 running sum.

    `torch.multinomial` drew the same distribution at 4.2 ms for one draw from a 152,064-token
    vocabulary on one core; this takes about 0.2 ms, and a sampled row's draw runs on the
    scheduler's thread at every step it joins (docs/benchmarks.md, "The agent API"). An id of
    probability 0 is never drawn."""
    cdf = torch.cumsum(probs.double(), dim=0)
    total = float(cdf[-1])
    if not (0.0 < total < float("inf")):  # NaN fails this too
        raise NothingToDraw(f"the token probabilities sum to {total}: nothing can be drawn")
    u = torch.rand(1, generator=gen, dtype=torch.float64)
    i = int(torch.searchsorted(cdf, u * cdf[-1], right=True))
    if i >= len(cdf):  # u * total rounded up to the total: the last id that can be drawn
        i = int(torch.nonzero(probs > 0)[-1])
    return i


class ReplyText:
    """The reply of one request as its tokens arrive.

    `add(token)` records a sampled token and returns the text that may be streamed now. After it,
    `eos` says the token ended the reply (the rest comes from `rest()`), `stopped` that a stop
    string did (the text before it was already returned; nothing follows). With `ignore_eos`
    (the request's flag) an end-of-sequence token ends nothing: it is kept in `ids` (it was
    sampled, and is fed like any other) but adds no text, whatever the tokenizer would decode
    it to, and `eos` stays false.

    The text is decoded incrementally, so a token costs the same at the end of a long reply as
    at its start. Decoding the whole reply again for every token (as this class once did) made
    a token's host time grow with the reply: 14 us at 64 tokens, 175 us at 1,024 and 666 us at
    4,096 on a 2-core CPU (`bench/reply_text.py`), on the batch scheduler's thread, for every
    sequence of every step. The ids are split at a boundary `_base`: the text of the ids before
    it is final (`_final`), and only the ids after it are decoded again, beside the few before
    it (from `_ctx`) as context, so a decoder that treats the start of a text specially (a
    leading space, bytes of one character split over tokens) sees them as in the whole reply.
    The boundary moves forward once `WINDOW` ids are past it and their text ends on a whole
    character.
    """

    WINDOW = 8

    def __init__(
        self,
        tokenizer: Any,
        eos_ids: Collection[int],
        stop: Sequence[str],
        ignore_eos: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.ignore_eos = ignore_eos
        self.stop = tuple(stop)
        self.ids: list[int] = []  # every sampled id, EOS included (ending the reply or not)
        self.sent = 0  # characters of the reply already streamed
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.eos = False
        self.stopped = False
        self._content: list[int] = []  # the ids that make text (no EOS)
        self._final = ""  # the text of _content[:_base]
        self._base = 0
        self._ctx = 0  # _content[_ctx:_base] is decoded as context for the ids after _base
        self._ctx_chars = 0  # ... into this many characters
        self._scanned = 0  # characters of the text already searched for stop strings

    def _decode(self, ids: list[int]) -> str:
        text: str = self.tokenizer.decode(ids, skip_special_tokens=True)
        return text

    def text(self) -> str:
        """The text of every id so far (an incomplete character at the end as U+FFFD)."""
        window = self._decode(self._content[self._ctx :])
        text = self._final + window[self._ctx_chars :]
        if len(self._content) - self._base >= self.WINDOW and not window.endswith("\ufffd"):
            self._final, self._ctx, self._base = text, self._base, len(self._content)
            self._ctx_chars = len(self._decode(self._content[self._ctx : self._base]))
        return text

    def add(self, token: int) -> str:
        self.ids.append(token)
        if token in self.eos_ids:
            self.eos = not self.ignore_eos
            return ""
        self._content.append(token)
        text = self.text()
        # a stop string ends after the last search, or overlaps its end (a character that was
        # incomplete then may be whole now: search again from a little before)
        start = max(0, self._scanned - self.hold - 4)
        self._scanned = len(text)
        cut = min((i for i in (text.find(s, start) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            delta = text[self.sent : cut] if cut > self.sent else ""
            self.sent = max(self.sent, cut)
            return delta
        # an incomplete UTF-8 sequence at the end: wait for its rest. It can be more than one
        # U+FFFD: a byte-fallback decoder (Llama's, Mistral's) gives one per byte of it
        ready = min(len(text) - self.hold, len(text.rstrip("\ufffd")))
        if ready > self.sent:
            delta = text[self.sent : ready]
            self.sent = ready
            return delta
        return ""

    def rest(self) -> str:
        """The text still held back, at a normal end of the reply (EOS or max_tokens)."""
        text = self.text()
        delta = text[self.sent :] if len(text) > self.sent else ""
        self.sent = max(self.sent, len(text))
        return delta
