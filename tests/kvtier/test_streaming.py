"""Degraded mode's attention sinks + sliding window: what it selects, and its quality cost on
the trained tiny Llama of test_codecs (perplexity and greedy agreement against full attention).

A degraded turn runs over the first S tokens and the last W tokens of the prompt, positions
given anew (kvtier.server.devices.streaming); its reply then extends that view. Emulated here
teacher-forced: a 512-token prompt, the next 256 tokens scored, full attention against the
sinks + window view, on held-out texts of the training distribution.

Degraded mode's int8 pages (`degraded_kv = "int8"`) are measured on the real path: the prompt
(whole, or its sinks + window view) prefilled into a `PagePool` of that kind through
`BatchRunner`, then the scored tokens decoded one step each (teacher-forced), every step's
attention reading the pages; native pages are the control (equal to full attention).
"""

from __future__ import annotations

import copy
import math
import random
from typing import Any

import pytest
import torch
from test_codecs import _corpus, _train

from kvtier.geometry import KVGeometry
from kvtier.paged import BatchRunner, PagedSequence, PagePool, SeqInput
from kvtier.server.devices.streaming import streaming_ids

PROMPT, SCORED, TEXTS = 512, 256, 4
VIEWS = ((4, 16), (0, 16), (4, 64), (0, 64), (4, 128), (4, 256))  # (sinks, window); 0: none


def test_streaming_ids_keeps_sinks_and_window() -> None:
    ids = list(range(100))
    assert streaming_ids(ids, 4, 10) == [0, 1, 2, 3, *range(90, 100)]
    assert streaming_ids(ids, 0, 10) == list(range(90, 100))
    assert streaming_ids(ids, 4, 96) is None  # not longer than sinks + window: unchanged
    assert streaming_ids(ids, 4, 0) is None  # off


def measure(model: torch.nn.Module) -> dict[tuple[int, int], dict[str, float]]:
    """Per (sinks, window): perplexity full -> view, and greedy agreement, over TEXTS texts."""
    net = model.float()
    sums: dict[tuple[int, int], list[float]] = {v: [0.0, 0.0, 0.0] for v in VIEWS}
    full_nll = 0.0
    with torch.no_grad():
        for t in range(TEXTS):
            ids = list(_corpus(random.Random(500 + t), PROMPT + SCORED))
            target = torch.tensor(ids[PROMPT:])
            full = net(input_ids=torch.tensor([ids[:-1]])).logits[0, PROMPT - 1 :].float()
            full_nll += float(torch.nn.functional.cross_entropy(full, target))
            for sinks, window in VIEWS:
                view = streaming_ids(ids[:PROMPT], sinks, window)
                assert view is not None
                x = torch.tensor([view + ids[PROMPT:-1]])
                logits = net(input_ids=x).logits[0, len(view) - 1 :].float()
                s = sums[(sinks, window)]
                s[0] += float(torch.nn.functional.cross_entropy(logits, target))
                s[1] += float((logits.argmax(-1) == full.argmax(-1)).float().mean())
    return _summary(sums, full_nll)


def _summary(sums: dict[Any, list[float]], full_nll: float) -> dict[Any, dict[str, float]]:
    """Per view: perplexity against the full context's, and greedy agreement with it."""
    out = {}
    ppl_full = math.exp(full_nll / TEXTS)
    for key, (nll, agree, *_) in sums.items():
        ppl = math.exp(nll / TEXTS)
        out[key] = {"ppl_full": ppl_full, "ppl": ppl, "change": ppl / ppl_full - 1.0,
                    "agreement": agree / TEXTS}  # fmt: skip
    return out


@pytest.mark.slow
def test_streaming_quality_on_a_trained_tiny_llama() -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as test_codecs: one thread keeps training time machine-independent
    try:
        results = measure(_train())
    finally:
        torch.set_num_threads(threads)
    print("\nsinks window   ppl full -> view (change)   greedy agreement")
    for (sinks, window), r in results.items():
        print(
            f"{sinks:5} {window:6}   {r['ppl_full']:.4f} -> {r['ppl']:.4f} ({r['change']:+.2%})"
            f"   {r['agreement']:.4f}"
        )
    best = results[(4, 256)]
    assert best["change"] < 0.10 and best["agreement"] > 0.85
    assert all(r["change"] < 0.5 for r in results.values())


# (kv, sinks, window): window 0 = the whole prompt (no sinks + window view)
PAGED = (("native", 0, 0), ("int8", 0, 0), ("int8", 4, 64), ("int8", 4, 128), ("int8", 4, 256))


def _paged_logits(runner: BatchRunner, prompt: list[int], scored: list[int]) -> torch.Tensor:
    """`prompt` prefilled into the runner's pool, then `scored[:-1]` decoded one token a step:
    the logits `[len(scored), vocab]` of each next token (teacher-forced)."""
    seq = PagedSequence()
    try:
        rows = [runner.step([SeqInput(seq, prompt)])[0]]
        rows += [runner.step([SeqInput(seq, [t])])[0] for t in scored[:-1]]
    finally:
        runner.release(seq)
    return torch.stack(rows).float()


def measure_paged(model: torch.nn.Module) -> dict[tuple[str, int, int], dict[str, float]]:
    """Per (kv, sinks, window) of PAGED: perplexity full -> paged, and greedy agreement."""
    net = model.float()
    paged = copy.deepcopy(net)  # BatchRunner switches its attention to the paged one
    geometry = KVGeometry.from_config(paged.config)
    runners = {
        kv: BatchRunner(
            paged,
            PagePool(geometry, 2**22, page_size=16, kv_dtype=kv),
            max_batch=1,
            max_tokens=PROMPT,
            max_seq_len=PROMPT + SCORED,
        )
        for kv in ("native", "int8")
    }
    sums: dict[tuple[str, int, int], list[float]] = {v: [0.0, 0.0] for v in PAGED}
    full_nll = 0.0
    with torch.no_grad():
        for t in range(TEXTS):
            ids = list(_corpus(random.Random(500 + t), PROMPT + SCORED))
            target = torch.tensor(ids[PROMPT:])
            full = net(input_ids=torch.tensor([ids[:-1]])).logits[0, PROMPT - 1 :].float()
            full_nll += float(torch.nn.functional.cross_entropy(full, target))
            for kv, sinks, window in PAGED:
                view = streaming_ids(ids[:PROMPT], sinks, window) if window else ids[:PROMPT]
                assert view is not None
                logits = _paged_logits(runners[kv], view, ids[PROMPT:])
                s = sums[(kv, sinks, window)]
                s[0] += float(torch.nn.functional.cross_entropy(logits, target))
                s[1] += float((logits.argmax(-1) == full.argmax(-1)).float().mean())
    return _summary(sums, full_nll)


@pytest.mark.slow
def test_int8_pages_quality_on_a_trained_tiny_llama() -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        results = measure_paged(_train())
    finally:
        torch.set_num_threads(threads)
    print("\nkv     sinks window   ppl full -> paged (change)   greedy agreement")
    for (kv, sinks, window), r in results.items():
        print(
            f"{kv:6} {sinks:5} {window or 'all':>6}   {r['ppl_full']:.4f} -> {r['ppl']:.4f} "
            f"({r['change']:+.3%})   {r['agreement']:.4f}"
        )
    control = results[("native", 0, 0)]
    assert abs(control["change"]) < 1e-4 and control["agreement"] > 0.99  # the harness is exact
    alone = results[("int8", 0, 0)]
    assert abs(alone["change"]) < 0.02 and alone["agreement"] > 0.97
    best = results[("int8", 4, 256)]
    assert best["change"] < 0.10 and best["agreement"] > 0.85
