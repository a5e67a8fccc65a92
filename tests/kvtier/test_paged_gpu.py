"""Paged attention's CUDA paths (the Triton decode kernel, varlen_attn) against the reference.

Run on a GPU machine; skipped elsewhere."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import MODELS
from test_paged import _greedy_alone, _paged, _prompts, _serve, _Session

from kvtier.paged import PagedSequence, SeqInput

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _case(batch_lens, heads, kv_heads, dim, page, dtype):  # type: ignore[no-untyped-def]
    g = torch.Generator(device="cuda").manual_seed(0)
    per_seq = [-(-n // page) for n in batch_lens]
    pages = sum(per_seq) + 3
    k_cache = torch.randn(pages, page, kv_heads, dim, device="cuda", generator=g).to(dtype)
    v_cache = torch.randn(pages, page, kv_heads, dim, device="cuda", generator=g).to(dtype)
    perm = torch.randperm(pages, device="cuda", generator=g)
    table = torch.zeros(len(batch_lens), max(per_seq), dtype=torch.int32, device="cuda")
    used = 0
    for i, n in enumerate(per_seq):
        table[i, :n] = perm[used : used + n].to(torch.int32)
        used += n
    q = torch.randn(len(batch_lens), heads, dim, device="cuda", generator=g).to(dtype)
    lens = torch.tensor(batch_lens, dtype=torch.int32, device="cuda")
    return q, k_cache, v_cache, table, lens


def _reference(q, k_cache, v_cache, table, batch_lens, scale):  # type: ignore[no-untyped-def]
    rep = q.shape[1] // k_cache.shape[2]
    outs = []
    for i, n in enumerate(batch_lens):
        pages = table[i, : -(-n // k_cache.shape[1])].long()
        k = k_cache[pages].flatten(0, 1)[:n].float().repeat_interleave(rep, 1).transpose(0, 1)
        v = v_cache[pages].flatten(0, 1)[:n].float().repeat_interleave(rep, 1).transpose(0, 1)
        outs.append(F.scaled_dot_product_attention(q[i, :, None].float(), k, v, scale=scale)[:, 0])
    return torch.stack(outs)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("page", [1, 16, 256])
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(28, 4, 128), (4, 4, 64), (8, 1, 80)])
@pytest.mark.parametrize("splits", [None, 1, 5])
def test_triton_decode_matches_reference(dtype, page, heads, kv_heads, dim, splits) -> None:  # type: ignore[no-untyped-def]
    from kvtier.paged.triton_decode import paged_decode

    batch_lens = [1, 15, 16, 17, 300, 1000, 257]
    q, k_cache, v_cache, table, lens = _case(batch_lens, heads, kv_heads, dim, page, dtype)
    scale = dim**-0.5
    got = paged_decode(q, k_cache, v_cache, table, lens, scale, num_splits=splits)
    want = _reference(q, k_cache, v_cache, table, batch_lens, scale)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)


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


def test_triton_backend_in_the_model() -> None:
    """Prefill through the reference path, then decode steps through the Triton kernel."""
    runner = _paged("qwen2", device="cuda", backend="reference")
    reference = MODELS["qwen2"]().cuda()
    prompts = _prompts(9, [20, 33, 9])
    seqs = [PagedSequence() for _ in prompts]
    logits = runner.step([SeqInput(s, p) for s, p in zip(seqs, prompts, strict=True)])
    outs = [[int(row.argmax())] for row in logits]
    runner.backend = "triton"
    for _ in range(7):
        logits = runner.step([SeqInput(s, [o[-1]]) for s, o in zip(seqs, outs, strict=True)])
        for o, row in zip(outs, logits, strict=True):
            o.append(int(row.argmax()))
    for p, o in zip(prompts, outs, strict=True):
        assert o == _greedy_alone(reference, p, 8)
