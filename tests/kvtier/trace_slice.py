"""A small request trace in Mooncake's format, made here (the real trace is not in the repo).

Conversations share a first block (a system prompt); each turn extends its conversation's
previous prompt by a few new blocks, the last one partial, as the real trace's do.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

BLOCK = 512


def write_trace(
    path: Path,
    conversations: int = 6,
    turns: int = 3,
    gap_ms: int = 400,
    seed: int = 0,
    output: int = 8,
) -> Path:
    rng = random.Random(seed)
    next_id = 1  # block 0: the system prompt every conversation starts with
    rows = []
    for c in range(conversations):
        blocks = [0]
        at = c * gap_ms // 2
        for _ in range(turns):
            for _ in range(rng.randint(2, 3)):
                blocks.append(next_id)
                next_id += 1
            n_in = (len(blocks) - 1) * BLOCK + rng.randint(100, BLOCK)
            rows.append((at, n_in, output, list(blocks)))
            blocks[-1] = next_id  # the next turn's block there is whole: another id
            next_id += 1
            at += gap_ms * conversations // 2
    rows.sort(key=lambda r: r[0])
    with path.open("w") as f:
        for at, n_in, n_out, ids in rows:
            f.write(
                json.dumps(
                    {"timestamp": at, "input_length": n_in, "output_length": n_out, "hash_ids": ids}
                )
                + "\n"
            )
    return path
