"""Paged attention's CUDA paths (the Triton decode kernel, varlen_attn) against the reference.

Run on a GPU machine; skipped elsewhere."""

from __future__ import annotations

import pytest
import torch
from conftest import MODELS
from test_paged import _greedy_alone, _paged, _prompts, _serve, _Session

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_varlen_paged_matches_reference() -> None:
    from kvtier.paged.attention import varlen_block_table_supported

    if not varlen_block_table_supported():
        pytest.skip(f"torch {torch.__version__} has no varlen_attn(block_table=)")
    runner = _paged("llama", device="cuda", backend="varlen")
    sessions = [_Session(p, 6, j) for p, j in zip(_prompts(3, [9, 40, 17]), [0, 1, 1], strict=True)]
    _serve(runner, sessions, budget=24)
    reference = MODELS["llama"]().cuda()
    for s in sessions:
        assert s.out == _greedy_alone(reference, s.prompt, s.new)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_cuda_batched_greedy_equals_each_session_alone(name: str) -> None:
    runner = _paged(name, device="cuda")
    reference = MODELS[name]().cuda()
    lengths, news, joins = [5, 16, 17, 33, 50], [8, 12, 6, 10, 9], [0, 0, 2, 3, 5]
    sessions = [
        _Session(p, n, j) for p, n, j in zip(_prompts(7, lengths), news, joins, strict=True)
    ]
    _serve(runner, sessions, budget=24)
    for s in sessions:
        assert s.out == _greedy_alone(reference, s.prompt, s.new)
