"""What a turn does to its logits before a token is drawn, and what it reports after.

A turn that asks for none of it (the common case) has no `Decoding` and its row is not
touched. One that does gets a `Decoding` with its own state:

- penalties (OpenAI's `presence_penalty` and `frequency_penalty` over the reply's tokens so far,
  and `repetition_penalty` over the prompt and the reply, as transformers and vLLM apply it);
- a grammar matcher (`kvtier.server.decoding.grammar`): the ids the grammar forbids are masked;
- `logprobs`: the drawn token's log-probability and the `top_logprobs` most likely ids, taken
  after the penalties and the mask, before temperature and top-p.

`process` runs on the rows of a step's logits (the batch's, or one request's), `record` after
the draw: it advances the matchers and the counts and keeps each token's logprobs in
`Decoding.pending` until the reply's text that carries them is sent.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from kvtier.errors import InvalidRequest


class NoTokenAllowed(InvalidRequest):
    """The turn's grammar allows no token of the model's vocabulary."""

    def __init__(self) -> None:
        super().__init__(
            "the response format's grammar allows no token of this model's vocabulary; "
            "relax the schema"
        )


# The most `top_logprobs` a request may ask for (OpenAI's limit).
MAX_TOP_LOGPROBS = 20


@dataclass
class TokenLogprob:
    token: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class Decoding:
    """One turn's logits processing and its state."""

    presence: float = 0.0
    frequency: float = 0.0
    repetition: float = 1.0
    logprobs: int | None = None  # top ids to report with each token; None: no logprobs
    matcher: Any = None  # an xgrammar GrammarMatcher
    counts: dict[int, int] = field(default_factory=dict)  # the reply's ids so far
    # the ids of the prompt and the reply so far (repetition_penalty), kept as tokens come:
    # not the prompt's set made again at every step
    seen: set[int] = field(default_factory=set)
    pending: list[TokenLogprob] = field(default_factory=list)

    @property
    def penalized(self) -> bool:
        return self.presence != 0.0 or self.frequency != 0.0 or self.repetition != 1.0

    def take_pending(self) -> list[TokenLogprob]:
        out, self.pending = self.pending, []
        return out


def decoding_of(job: Any) -> Decoding | None:
    """The turn's Decoding, or None when it asks for nothing that touches its logits."""
    d = Decoding(
        presence=float(job.presence_penalty),
        frequency=float(job.frequency_penalty),
        repetition=float(job.repetition_penalty),
        logprobs=job.logprobs,
        matcher=job.grammar() if job.grammar is not None else None,
        seen=set(job.prompt_ids) if float(job.repetition_penalty) != 1.0 else set(),
    )
    if not d.penalized and d.logprobs is None and d.matcher is None:
        return None
    return d


def process(
    logits: torch.Tensor,
    decodings: list[Decoding | None],
    faults: dict[int, BaseException] | None = None,
) -> None:
    """Penalties and grammar masks, in place, on the rows of `logits` that have a Decoding.

    A row whose processing raises, or whose grammar leaves no token of the model's vocabulary
    (a grammar and a vocabulary that do not fit, `NoTokenAllowed`), is a fault of that row
    alone: with `faults` it is put there (row -> exception) with its logits zeroed (any draw is
    safe) and the other rows are processed as usual, for the caller to fail its turn; without,
    the first such exception is raised."""
    found: dict[int, BaseException] = {}
    for i, d in enumerate(decodings):
        if d is not None and d.penalized:
            try:
                _penalize(logits[i], d)
            except Exception as exc:
                found[i] = exc
    masked = [
        (i, d.matcher)
        for i, d in enumerate(decodings)
        if i not in found
        and d is not None
        and d.matcher is not None
        and not d.matcher.is_terminated()
    ]
    if masked:
        from kvtier.server.decoding.grammar import apply_masks

        rows = [i for i, _ in masked]
        apply_masks(logits, rows, [m for _, m in masked], found)
        # a row keeps a token where its largest logit is above -inf (a view per row: no copy)
        for r in rows:
            if r not in found and not bool(logits[r].max() > float("-inf")):
                found[r] = NoTokenAllowed()
    if found:
        logits[sorted(found)] = 0.0
    if faults is None:
        if found:
            raise next(iter(found.values()))
        return
    faults.update(found)


def _penalize(row: torch.Tensor, d: Decoding) -> None:
    if d.repetition != 1.0:
        seen = torch.tensor(list(d.seen), device=row.device)
        if len(seen):
            vals = row[seen]
            row[seen] = torch.where(vals > 0, vals / d.repetition, vals * d.repetition)
    if d.counts and (d.presence or d.frequency):
        ids = torch.tensor(list(d.counts), device=row.device)
        counts = torch.tensor(list(d.counts.values()), dtype=row.dtype, device=row.device)
        row[ids] -= d.presence + d.frequency * counts


# The log-probability reported for a token the mask or the penalties made impossible (-inf,
# which JSON cannot carry), as vLLM reports it; such tokens are left out of `top`.
LOGPROB_FLOOR = -9999.0


def record(
    logits: torch.Tensor,
    decodings: list[Decoding | None],
    tokens: list[int],
    faults: dict[int, BaseException] | None = None,
) -> None:
    """After the draw: count each row's token, advance its matcher, keep its logprobs.

    The rows in `faults` are skipped; a row whose matcher refuses its token is added to it
    (without `faults`, that raises)."""
    skip = faults if faults is not None else {}
    want = [
        i
        for i, d in enumerate(decodings)
        if d is not None and d.logprobs is not None and i not in skip
    ]
    if want:
        logp = torch.log_softmax(logits[want].float(), dim=-1)
        k = max(int(decodings[i].logprobs or 0) for i in want)  # type: ignore[union-attr]
        top_v, top_i = logp.topk(k, dim=-1) if k else (logp[:, :0], logp[:, :0].long())
        chosen = logp.gather(1, torch.tensor([[tokens[i]] for i in want], device=logp.device))
        chosen_l, top_vl, top_il = chosen[:, 0].tolist(), top_v.tolist(), top_i.tolist()
        for j, i in enumerate(want):
            d = decodings[i]
            assert d is not None and d.logprobs is not None
            pairs = zip(top_il[j][: d.logprobs], top_vl[j][: d.logprobs], strict=True)
            top = [(t, v) for t, v in pairs if math.isfinite(v)]
            mine = chosen_l[j] if math.isfinite(chosen_l[j]) else LOGPROB_FLOOR
            d.pending.append(TokenLogprob(tokens[i], mine, top))
    for i, (d, token) in enumerate(zip(decodings, tokens, strict=True)):
        if d is None or i in skip:
            continue
        d.counts[token] = d.counts.get(token, 0) + 1
        if d.repetition != 1.0:
            d.seen.add(token)
        if d.matcher is not None and not d.matcher.is_terminated():
            try:
                d.matcher.accept_token(token)
            except Exception as exc:
                if faults is None:
                    raise
                faults[i] = exc
