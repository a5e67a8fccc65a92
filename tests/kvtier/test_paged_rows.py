"""The "rows" paged attention (every new token one row: decode tokens and prompt chunks alike)
and the padded steps that CUDA graphs replay, checked on the CPU through the per-row reference
with the same contract as the Triton kernel (which tests/kvtier/test_paged_graphs.py checks on a
GPU)."""

from __future__ import annotations

import pytest
import torch
from conftest import MODELS
from test_paged import _greedy_alone, _paged, _prompts, _serve, _Session

from kvtier.paged import PagedSequence, SeqInput
from kvtier.paged.context import paged_context
from kvtier.paged.graphs import default_buckets, padded_context


def test_default_buckets() -> None:
    assert default_buckets(1) == [1]
    assert default_buckets(8) == [1, 2, 4, 8]
    assert default_buckets(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert default_buckets(40) == [1, 2, 4, 8, 16, 32, 40]
    # prompt chunks: 2x, 3x, ... max_batch up to max_tokens (always a bucket), at most 16
    assert default_buckets(8, 64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert default_buckets(64, 1024) == [1, 2, 4, 8, 16, 32, 48, 64, *range(128, 1025, 64)]
    assert len(default_buckets(64, 8192)) <= 8 + 17


@pytest.mark.parametrize("name", sorted(MODELS))
def test_rows_greedy_equals_each_session_alone(name: str) -> None:
    """Mixed lengths, sessions joining mid-run, prompt chunks beside decode tokens."""
    runner = _paged(name, backend="rows")
    reference = MODELS[name]()
    lengths, news, joins = [5, 16, 17, 33, 50], [8, 12, 6, 10, 9], [0, 0, 2, 3, 5]
    sessions = [
        _Session(p, n, j) for p, n, j in zip(_prompts(5, lengths), news, joins, strict=True)
    ]
    sizes = _serve(runner, sessions, budget=24)
    assert max(sizes) > 1
    for s in sessions:
        assert s.out == _greedy_alone(reference, s.prompt, s.new)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_padded_decode_only_step_equals_the_plain_step(name: str) -> None:
    """A step of decode tokens alone, run as its decode-only CUDA graph would run it (every row
    on its own: no row blocks in the context), gives the plain step's logits."""
    runner = _paged(name)
    twin = _paged(name)
    twin.model.load_state_dict(runner.model.state_dict())
    runner.reserve_padding_page()
    seqs, twins = [PagedSequence() for _ in range(3)], [PagedSequence() for _ in range(3)]
    prompts = _prompts(5, [9, 20, 3])
    for group, r in ((seqs, runner), (twins, twin)):
        r.step([SeqInput(s, p) for s, p in zip(group, prompts, strict=True)])
    want = twin.step([SeqInput(s, [7]) for s in twins])
    batch = [SeqInput(s, [7]) for s in seqs]
    size = 4  # 3 decode tokens padded to the bucket of 4
    runner.prepare(batch, pad_to=size)
    ctx = padded_context(runner, size, decode_only=True)
    assert ctx.row_blocks is None and padded_context(runner, size).row_blocks is not None
    with torch.inference_mode(), paged_context(ctx):
        got = runner.forward(size, logits_to_keep=runner.last_index[:size])
    runner.advance(batch)
    torch.testing.assert_close(got[:3], want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_padded_step_equals_the_plain_step(name: str) -> None:
    """A step run as its CUDA graph would run it (padding tokens and sequence rows up to the
    bucket, the "rows" context over the runner's fixed buffers) gives the plain step's logits,
    and the padding writes only to the padding page."""
    runner = _paged(name)
    twin = _paged(name)
    twin.model.load_state_dict(runner.model.state_dict())
    pad_page = runner.reserve_padding_page()
    a, b, c = (PagedSequence() for _ in range(3))
    a2, b2, c2 = (PagedSequence() for _ in range(3))
    prompts = _prompts(11, [9, 20, 3])
    for seqs, r in (((a, b, c), runner), ((a2, b2, c2), twin)):
        r.step([SeqInput(s, p) for s, p in zip(seqs, prompts, strict=True)])
    step = [[7], [4, 5, 6, 7, 8], [9]]  # a decode token, a prompt chunk, a decode token
    want = twin.step([SeqInput(s, t) for s, t in zip((a2, b2, c2), step, strict=True)])
    before = runner.pool.kv.clone()
    batch = [SeqInput(s, t) for s, t in zip((a, b, c), step, strict=True)]
    size = 32  # 7 tokens padded to 32; 3 sequence rows padded to max_batch (16)
    runner.prepare(batch, pad_to=size)
    with torch.inference_mode(), paged_context(padded_context(runner, size)):
        got = runner.forward(size, logits_to_keep=runner.last_index[: runner.max_batch])
    runner.advance(batch)
    torch.testing.assert_close(got[:3], want, rtol=1e-4, atol=1e-4)
    changed = (runner.pool.kv != before).flatten(3).any(-1)  # [layer, k|v, page, slot]
    pages = set(changed.nonzero()[:, 2].tolist())
    assert pad_page in pages, "the padding tokens' K/V goes to the padding page"
    owned = {p for s in (a, b, c) for p in s.pages}
    assert pages <= owned | {pad_page}, "padding never writes a sequence's page"
