"""Row blocks of the "rows" attention path (kvtier.paged.rowblocks) and the runner's step
buffers that carry them: every row of a step in exactly one block, a block never spanning two
sequences, the prompt tiles first and within a graph bucket's prefill grid. (The kernels:
tests/kvtier/test_paged_triton.py.)"""

from __future__ import annotations

import pytest
import torch
from conftest import MODELS

from kvtier.geometry import KVGeometry
from kvtier.paged import BatchRunner, PagedSequence, PagePool, SeqInput
from kvtier.paged.rowblocks import count_tiles, max_tiles, row_blocks


def test_row_blocks_put_prompt_tiles_first_and_decode_tokens_alone() -> None:
    first, rows = row_blocks([1, 20, 1, 8, 3, 2], 8)
    assert list(zip(first, rows, strict=True)) == [
        (1, 8),
        (9, 8),
        (17, 4),
        (22, 8),
        (30, 3),
        (33, 2),
        (0, 1),
        (21, 1),
    ]
    assert count_tiles([1, 20, 1, 8, 3, 2], 8) == 6
    assert row_blocks([], 8) == ([], [])


def test_max_tiles_bounds_every_step_of_a_bucket() -> None:
    """No step of at most `tokens` new tokens from at most `max_batch` sequences has more
    tiles than `max_tiles` (exhaustive over small steps), and the bound is reached."""

    def steps(tokens: int, parts: int) -> list[list[int]]:
        """Every step of at most `tokens` new tokens in at most `parts` sequences."""
        if parts == 0 or tokens == 0:
            return [[]]
        out: list[list[int]] = [[]]
        for n in range(1, tokens + 1):
            out += [[n, *rest] for rest in steps(tokens - n, parts - 1)]
        return out

    for per_tile, max_batch in ((4, 3), (3, 6), (8, 12), (64, 2)):
        for tokens in range(1, 13):
            worst = max(count_tiles(lens, per_tile) for lens in steps(tokens, max_batch))
            assert worst <= max_tiles(tokens, max_batch, per_tile), (per_tile, max_batch, tokens)
    assert max_tiles(1024, 64, 64) == 80
    assert max_tiles(64, 64, 64) == 32  # 32 chunks of two tokens


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
    per = runner.tile_tokens
    assert max(n for _, n in used) == min(per, 19)
    assert rows[0] > 1 and rows[1] > 1  # the two chunks' tiles come before the decode token
