"""Paged attention on CUDA: varlen_attn against the reference, batched greedy on the GPU.

Run on a GPU machine; skipped elsewhere. The Triton kernel's tests are in test_paged_triton.py."""

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


def test_varlen_paged_matches_reference() -> None:
    """A mixed step (fresh prefill, prefill after a prefix, decode) through varlen_attn, bf16."""
    from kvtier.paged.attention import attend, varlen_block_table_supported, write_kv
    from kvtier.paged.reference import reference_paged

    if not varlen_block_table_supported():
        pytest.skip(f"torch {torch.__version__} has no varlen_attn(block_table=)")
    geo = KVGeometry(2, 4, 128, 128, "bfloat16", "gqa")
    pool = PagePool(geo, 64 * 256 * geo.bytes_per_token, page_size=256, device="cuda")
    runner = BatchRunner(MODELS["llama"]().cuda(), pool, max_tokens=2048, max_seq_len=4096)
    runner.backend = "varlen"
    seqs = [PagedSequence() for _ in range(3)]
    g = torch.Generator(device="cuda").manual_seed(0)
    k_cache, v_cache = pool.layer_cache(0)

    def step(items: list[SeqInput]) -> tuple[torch.Tensor, torch.Tensor]:
        ctx = runner.prepare(items)
        total = int(ctx.slot_mapping.shape[0])
        q = torch.randn(total, 28, 128, device="cuda", generator=g).bfloat16()
        kv = torch.randn(2, total, 4, 128, device="cuda", generator=g).bfloat16()
        write_kv(k_cache, v_cache, kv[0], kv[1], ctx.slot_mapping)
        got = attend(ctx, q, k_cache, v_cache, 128**-0.5)
        want = reference_paged(ctx, q, k_cache, v_cache, 128**-0.5)
        runner.advance(items)
        return got, want

    step([SeqInput(seqs[1], [0] * 300), SeqInput(seqs[2], [0] * 1000)])
    got, want = step(
        [SeqInput(seqs[0], [0] * 77), SeqInput(seqs[1], [0] * 40), SeqInput(seqs[2], [0])]
    )
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


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


def test_page_slots_reach_the_device_without_waiting_for_its_work() -> None:
    """`PagePool.slots` (a copy-in's and copy-out's indices) goes through pinned memory: from
    pageable memory the driver may wait for the stream, i.e. for the steps in flight, which
    stalled the scheduler thread. With the GPU busy for about half a second, the slots must
    arrive correct while the host returns long before the busy work ends."""
    import time

    geo = KVGeometry(2, 4, 64, 64, "bfloat16", "gqa")
    pool = PagePool(geo, 64 * 16 * geo.bytes_per_token, page_size=16, device="cuda")
    table = [5, 2, 9]
    pool.slots(table, 3, 40)  # the host allocator's first pinned block is made here
    torch.cuda.synchronize()
    torch.cuda._sleep(1_000_000_000)  # about 0.5 s of GPU time at ~2 GHz
    t0 = time.perf_counter()
    slots = pool.slots(table, 3, 40)
    returned = time.perf_counter() - t0
    busy_end = torch.cuda.Event()
    busy_end.record()
    assert not busy_end.query(), "the GPU finished its busy work before the check"
    assert returned < 0.1, f"slots waited {returned:.3f} s for the device"
    want = [p * 16 + o for p in table for o in range(16)][3:40]
    assert slots.tolist() == want
