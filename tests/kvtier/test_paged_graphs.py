"""CUDA graphs of the decode step: the replayed step gives the eager step's tokens and logits,
allocates no device memory, and pads odd batch sizes. Run on a GPU machine; skipped elsewhere."""

from __future__ import annotations

import pytest
import torch
from conftest import MODELS
from test_paged import _greedy_alone, _paged, _prompts, _serve, _Session

from kvtier.geometry import KVGeometry
from kvtier.paged import BatchRunner, PagedSequence, PagePool, SeqInput
from kvtier.paged.graphs import default_buckets

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_default_buckets() -> None:
    assert default_buckets(1) == [1]
    assert default_buckets(8) == [1, 2, 4, 8]
    assert default_buckets(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert default_buckets(40) == [1, 2, 4, 8, 16, 32, 40]


@pytest.mark.parametrize("name", sorted(MODELS))
def test_graph_greedy_equals_each_session_alone(name: str) -> None:
    """Sessions joining and leaving mid-run, batch sizes between buckets (padding rows)."""
    runner = _paged(name, device="cuda")
    assert runner.capture_graphs([1, 2, 4, 8, 16]) == [1, 2, 4, 8, 16]
    reference = MODELS[name]().cuda()
    lengths, news, joins = [5, 16, 17, 33, 50], [8, 12, 6, 10, 9], [0, 0, 2, 3, 5]
    sessions = [
        _Session(p, n, j) for p, n, j in zip(_prompts(7, lengths), news, joins, strict=True)
    ]
    _serve(runner, sessions, budget=24)
    assert runner.graph_steps > 3, "decode-only steps must replay a graph"
    assert runner.eager_steps > 0, "prompt chunks run eager"
    for s in sessions:
        assert s.out == _greedy_alone(reference, s.prompt, s.new)


def test_graph_logits_match_eager_bf16_and_allocate_nothing() -> None:
    """A 3-sequence decode step (bucket 4) of a bf16 model with long, uneven contexts: replayed
    logits match the eager step's; 20 replays make no cudaMalloc."""
    model = MODELS["qwen2"]().to("cuda", torch.bfloat16)
    geo = KVGeometry.from_config(model.config)
    pool = PagePool(geo, 512 * 16 * geo.bytes_per_token, page_size=16, device="cuda")
    runner = BatchRunner(model, pool, max_batch=8, max_tokens=2048, max_seq_len=2048)
    eager = BatchRunner(model, pool, max_batch=8, max_tokens=2048, max_seq_len=2048)
    runner.capture_graphs()
    seqs = [PagedSequence() for _ in range(3)]
    for seq, n in zip(seqs, [700, 33, 1500], strict=True):
        eager.step([SeqInput(seq, [5] * n)])
    fork = [pool.fork(seq) for seq in seqs]  # the same pages, read by the second runner
    want = eager.step([SeqInput(seq, [7]) for seq in fork])
    got = runner.step([SeqInput(seq, [7]) for seq in seqs])
    assert runner.graph_steps == 1
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()["num_device_alloc"]
    for _ in range(20):
        runner.step([SeqInput(seq, [7]) for seq in seqs])
    torch.cuda.synchronize()
    assert torch.cuda.memory_stats()["num_device_alloc"] == before
