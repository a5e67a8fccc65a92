"""The CUDA caching allocator's state, read only when torch is already imported and CUDA is up.

Importing torch or initializing CUDA from a collector would cost seconds and GPU memory, so a
process that has not done so itself gets None.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class TorchAllocState:
    """One device's allocator figures (bytes, and a count of retries after a failed cudaMalloc)."""

    device: int
    reserved_bytes: int
    allocated_bytes: int
    inactive_split_bytes: int  # free bytes stranded in split blocks: fragmentation
    alloc_retries: int  # cudaMalloc failed, caches were flushed and the call retried
    ooms: int
    largest_free_block_bytes: int  # largest inactive block in reserved segments

    @property
    def reserved_unused_bytes(self) -> int:
        return self.reserved_bytes - self.allocated_bytes


def from_stats(
    device: int, stats: dict[str, Any], segments: list[dict[str, Any]]
) -> TorchAllocState:
    """Build the state from `torch.cuda.memory_stats()` and `torch.cuda.memory_snapshot()`."""
    largest = 0
    for segment in segments:
        if segment.get("device", device) != device:
            continue
        for block in segment.get("blocks", []):
            if block.get("state") == "inactive":
                largest = max(largest, int(block.get("size", 0)))
    return TorchAllocState(
        device=device,
        reserved_bytes=int(stats.get("reserved_bytes.all.current", 0)),
        allocated_bytes=int(stats.get("allocated_bytes.all.current", 0)),
        inactive_split_bytes=int(stats.get("inactive_split_bytes.all.current", 0)),
        alloc_retries=int(stats.get("num_alloc_retries", 0)),
        ooms=int(stats.get("num_ooms", 0)),
        largest_free_block_bytes=largest,
    )


def read() -> list[TorchAllocState] | None:
    """Per-device allocator state; None unless torch is imported and CUDA initialized here."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    try:
        if not torch.cuda.is_available() or not torch.cuda.is_initialized():
            return None
        segments = torch.cuda.memory_snapshot()
        return [
            from_stats(d, torch.cuda.memory_stats(d), segments)
            for d in range(torch.cuda.device_count())
        ]
    except (RuntimeError, AttributeError):
        return None
