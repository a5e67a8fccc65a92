"""Row blocks of the "rows" attention kernel (kvtier.paged.rowblocks) and the runner's step
buffers that carry them: every row of a step in exactly one block, a block never spanning two
sequences. (The kernel itself: tests/kvtier/test_paged_triton.py.)"""

from __future__ import annotations

import pytest
import torch
from conftest import MODELS

from kvtier.geometry import KVGeometry
from kvtier.paged import BatchRunner, PagedSequence, PagePool, SeqInput
from kvtier.paged.rowblocks import row_blocks, rows_per_block


def test_rows_per_block_fills_a_tile_of_64_query_rows() -> None:
    assert rows_per_block(7) == 8  # Qwen2-7B: 28 query heads over 4 K/V heads
    assert rows_per_block(8) == 8
    assert rows_per_block(4) == 16
    assert rows_per_block(1) == 64  # plain multi-head attention
    assert rows_per_block(128) == 1


def test_row_blocks_cut_chunks_and_keep_decode_tokens_alone() -> None:
    first, rows = row_blocks([1, 20, 1, 8, 3], 8)
    assert list(zip(first, rows, strict=True)) == [
        (0, 1),
        (1, 8),
        (9, 8),
        (17, 4),
        (21, 1),
        (22, 8),
        (30, 3),
    ]
    assert row_blocks([], 8) == ([], [])


def _covered(first: list[int], rows: list[int], row_seq: list[int]) -> list[int]:
    seen = [0] * len(row_seq)
    for f, n in zip(first, rows, strict=True):
        assert len({row_seq[r] for r in range(f, f + n)}) <= 1, "a block spans two sequences"
        for r in range(f, f + n):
            seen[r] += 1
    return seen


@pytest.mark.parametrize("pad_to", [None, 64])
def test_runner_steps_carry_blocks_covering_each_row_once(pad_to: int | None) -> None:
    model = MODELS["qwen2"]()
    geo = KVGeometry.from_config(model.config)
    pool = PagePool(geo, 256 * 16 * geo.bytes_per_token, page_size=16, device="cpu")
    runner = BatchRunner(model, pool, max_batch=16, max_tokens=64, max_seq_len=512)
    if pad_to is not None:
        runner.reserve_padding_page()
    g = torch.Generator().manual_seed(0)
    seqs = [PagedSequence() for _ in range(3)]
    batch = [
        SeqInput(s, torch.randint(3, 200, (n,), generator=g).tolist())
        for s, n in zip(seqs, [19, 1, 5], strict=True)
    ]
    runner.prepare(batch, pad_to=pad_to)
    size = pad_to or 25
    first = runner.block_first[:size].tolist()
    rows = runner.block_rows[:size].tolist()
    used = [(f, n) for f, n in zip(first, rows, strict=True) if n > 0]
    row_seq = runner.row_seq[:size].tolist()
    assert _covered([f for f, _ in used], [n for _, n in used], row_seq) == [1] * size
    per = runner.rows_per_block
    assert max(n for _, n in used) == min(per, 19)
