"""Row blocks of the "rows" attention kernel: which query rows one program attends for.

In a step where every new token is one row of the Triton kernel (`kvtier.paged.triton_decode`),
a prompt chunk's rows all read the same sequence's K/V, each up to its own position. One program
per row would read that K/V once per row; a block of up to `rows_per_block(group)` consecutive
rows of one sequence reads each K/V block once for all of them, as one tile of
(rows x query heads of the GQA group) against the block. A decode token is a block of one row.

Pure functions over Python ints: the runner writes the result into its step buffers.
"""

from __future__ import annotations

from collections.abc import Sequence

TILE = 64  # query rows (token x head of a GQA group) of one program's tile


def pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def rows_per_block(group: int) -> int:
    """Tokens per block for `group` query heads per K/V head: the tile holds `TILE` rows
    (8 tokens of a group of 7 or 8 heads, 64 of plain multi-head attention)."""
    return max(1, TILE // pow2(group))


def row_blocks(query_lens: Sequence[int], per_block: int) -> tuple[list[int], list[int]]:
    """(first row, rows) of every block for sequences of `query_lens` new tokens laid out one
    after another: a one-token sequence is one block, a chunk is cut into blocks of at most
    `per_block` rows. There are never more blocks than rows."""
    first: list[int] = []
    rows: list[int] = []
    t = 0
    for n in query_lens:
        for b in range(t, t + n, per_block):
            first.append(b)
            rows.append(min(per_block, t + n - b))
        t += n
    return first, rows
