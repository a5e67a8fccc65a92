"""CUDA graphs of the batched step: a replayed step (decode tokens and prompt chunks alike) gives
the eager step's tokens and logits, allocates no device memory, and pads odd sizes. Run on a GPU
machine; skipped elsewhere (the padding logic is checked on the CPU in test_paged_rows.py)."""

from __future__ import annotations

import pytest
import torch
from conftest import MODELS
from test_paged import _greedy_alone, _paged, _prompts, _serve, _Session

from kvtier.geometry import KVGeometry
from kvtier.paged import BatchRunner, PagedSequence, PagePool, SeqInput

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize(
    ("buckets", "decode_graphs"), [(None, False), ([1, 2, 4, 8, 16], False), (None, True)]
)
def test_graph_greedy_equals_each_session_alone(
    name: str, buckets: list[int] | None, decode_graphs: bool
) -> None:
    """Sessions joining and leaving mid-run, prompt chunks beside decode tokens, steps between
    buckets (padding); with the default buckets every step replays, with small ones the steps
    of more than 16 tokens run eager. With decode graphs, the steps without prompt rows replay
    the one-row kernel's graph of their bucket, and the replies are the same."""
    runner = _paged(name, device="cuda")
    captured = runner.capture_graphs(buckets, decode_graphs=decode_graphs)
    assert captured == (buckets or [1, 2, 4, 8, 16, 32, 48, 64])
    assert runner.graphs is not None
    decode = [b for b in captured if b <= runner.max_batch] if decode_graphs else []
    assert runner.graphs.captured_decode == decode
    reference = MODELS[name]().cuda()
    lengths, news, joins = [5, 16, 17, 33, 50], [8, 12, 6, 10, 9], [0, 0, 2, 3, 5]
    sessions = [
        _Session(p, n, j) for p, n, j in zip(_prompts(7, lengths), news, joins, strict=True)
    ]
    sizes = _serve(runner, sessions, budget=24)
    assert runner.graph_steps > 3
    if buckets is None:
        assert runner.graph_steps == len(sizes) and runner.eager_steps == 0
    else:
        assert runner.eager_steps > 0
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


def test_graph_mixed_step_matches_eager_bf16() -> None:
    """A step of two decode tokens and a 300-token prompt chunk after 1,000 tokens, bf16:
    replayed (rows kernel, bucket 512) against the eager step (SDPA flash for the chunk)."""
    model = MODELS["llama"]().to("cuda", torch.bfloat16)
    geo = KVGeometry.from_config(model.config)
    pool = PagePool(geo, 512 * 16 * geo.bytes_per_token, page_size=16, device="cuda")
    runner = BatchRunner(model, pool, max_batch=8, max_tokens=512, max_seq_len=2048)
    eager = BatchRunner(model, pool, max_batch=8, max_tokens=2048, max_seq_len=2048)
    eager.backend = "split"
    runner.capture_graphs([8, 512])
    seqs = [PagedSequence() for _ in range(3)]
    for seq, n in zip(seqs, [400, 1000, 77], strict=True):
        eager.step([SeqInput(seq, [5] * n)])
    fork = [pool.fork(seq) for seq in seqs]
    step = [[7], [3 + i % 200 for i in range(300)], [9]]  # ids inside the tiny vocab
    want = eager.step([SeqInput(s, t) for s, t in zip(fork, step, strict=True)])
    got = runner.step([SeqInput(s, t) for s, t in zip(seqs, step, strict=True)])
    assert runner.graph_steps == 1
    torch.testing.assert_close(got.float(), want.float(), rtol=3e-2, atol=3e-2)


def test_graphs_share_one_logits_buffer() -> None:
    """Every bucket's graph, decode-only ones too, copies its logits into one buffer: each
    graph's own output would stay alive in the shared pool (about 0.4 GiB for a 7B model's 31
    graphs). A replay of one bucket then another leaves the second's logits, equal to eager."""
    model = MODELS["qwen2"]().to("cuda", torch.bfloat16)
    geo = KVGeometry.from_config(model.config)
    pool = PagePool(geo, 256 * 16 * geo.bytes_per_token, page_size=16, device="cuda")
    runner = BatchRunner(model, pool, max_batch=8, max_tokens=64, max_seq_len=1024)
    eager = BatchRunner(model, pool, max_batch=8, max_tokens=128, max_seq_len=1024)
    runner.capture_graphs(decode_graphs=True)
    assert runner.graphs is not None
    sizes = runner.graphs.captured
    ptrs = {runner.graphs.replay(size, decode).data_ptr() for size in sizes for decode in (0, 1)}
    assert len(sizes) > 3 and len(ptrs) == 1
    seqs = [PagedSequence() for _ in range(2)]
    for seq, n in zip(seqs, [40, 90], strict=True):
        eager.step([SeqInput(seq, [5] * n)])
    fork = [pool.fork(seq) for seq in seqs]
    want_one = eager.step([SeqInput(fork[0], [7])]).clone()
    want_two = eager.step([SeqInput(fork[0], [8]), SeqInput(fork[1], [3] * 20)]).clone()
    got_one = runner.step([SeqInput(seqs[0], [7])]).clone()  # bucket 1, decode-only
    got_two = runner.step([SeqInput(seqs[0], [8]), SeqInput(seqs[1], [3] * 20)])  # a mixed bucket
    assert runner.graph_steps == 2
    torch.testing.assert_close(got_one.float(), want_one.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got_two.float(), want_two.float(), rtol=3e-2, atol=3e-2)
