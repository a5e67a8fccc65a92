"""The blocks of a step's rows for the "rows" attention path: who attends for which new token.

Every new token of a step is one query row. A decode token (the only new token of its sequence)
is a block of one row, attended by the decode kernel (`kvtier.paged.triton_decode`), one program
per row. A prompt chunk's rows are cut into *tiles* of at most `TILE_TOKENS` consecutive tokens,
each attended by one program of the prefill kernel (`kvtier.paged.triton_prefill`) per query
head, which multiplies the whole tile against each block of the sequence's K/V. The tiles come
first in the list, so a CUDA graph's prefill launch covers them with a grid of
`max_tiles(bucket)` programs per head.

Pure functions over Python ints: the runner writes the result into its step buffers.
"""

from __future__ import annotations

from collections.abc import Sequence

TILE_TOKENS = 64  # query tokens of one prefill program's tile (one head)


def pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def row_blocks(
    query_lens: Sequence[int], per_tile: int = TILE_TOKENS
) -> tuple[list[int], list[int]]:
    """(first row, rows) of every block, for sequences of `query_lens` new tokens laid out one
    after another: first the tiles of every sequence of two or more new tokens (at most
    `per_tile` rows each), then a block of one row for every sequence of one. There are never
    more blocks than rows."""
    tiles_first: list[int] = []
    tiles_rows: list[int] = []
    single: list[int] = []
    t = 0
    for n in query_lens:
        if n == 1:
            single.append(t)
        else:
            for b in range(t, t + n, per_tile):
                tiles_first.append(b)
                tiles_rows.append(min(per_tile, t + n - b))
        t += n
    return tiles_first + single, tiles_rows + [1] * len(single)


def count_tiles(query_lens: Sequence[int], per_tile: int = TILE_TOKENS) -> int:
    """The prompt tiles `row_blocks` makes for these sequences."""
    return sum(-(-n // per_tile) for n in query_lens if n > 1)


def max_tiles(tokens: int, max_batch: int, per_tile: int = TILE_TOKENS) -> int:
    """The most prompt tiles a step of at most `tokens` new tokens from at most `max_batch`
    sequences can have: each chunk of n >= 2 tokens makes ceil(n / per_tile) <= n / 2 tiles
    (for tiles of 3 or more tokens; the kernel's are 16 or more), and all of them at most
    tokens / per_tile plus one per chunk."""
    chunks = min(max_batch, tokens // 2)
    return min(tokens // 2, -(-tokens // per_tile) + chunks)
