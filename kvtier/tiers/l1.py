"""L1: per-session, per-layer attention buffers on the model's device, under one byte budget.

Each session owns, per layer, a K and a V tensor of shape ``[1, kv_heads, capacity, head_dim]``
(transformers' layout), so attention reads them directly. All of them are views of one
allocation ``[layer, k|v, 1, kv_heads, capacity, head_dim]``: the transfer engine then moves a
group of chunks for every layer and plane in one strided copy instead of one per layer and
plane (56 launches for a 28-layer model), and growth is one copy too. When the GPU has no
contiguous range that large left (its free memory split into smaller pieces), a session gets one
tensor per layer and plane instead, which the engine also handles. Capacity grows in whole chunks: a
decode step writes one token into spare room, and only every ``chunk_tokens`` tokens does the
buffer move to a larger allocation (never a ``torch.cat`` per token).

On CUDA, kvtier's buffers come from a dedicated ``torch.cuda.MemPool`` so that session churn
fragments kvtier's own segments, never the blocks the model's activations use, and `reserve`
claims the whole budget for that pool at start: sessions are then carved out of one segment
instead of growing the pool one cudaMalloc (a device-wide synchronization) at a time, and a
budget the GPU cannot hold fails at start. The segment can still fragment: when many resident
sessions grow (each growth takes a larger block while the old one is alive) and no hole is large
enough, the allocator maps another segment for the pool (57 in a 9 s window of the 64-session
fleet on an H200, docs/benchmarks-history.md, "The restore threads' waits"). Carving the blocks from a
slab of exactly the budget instead was measured and reverted: under a hard budget, the holes of
blocks of varying sizes were too short so often that the 256-session fleet evicted its batch down
to 34 sessions (docs/benchmarks-history.md, "L1 out of one slab"). Fixed-size pages are the fix. On the
CPU the same code uses ordinary tensors.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvtier.errors import BudgetError, L1BudgetExceeded
from kvtier.geometry import KVGeometry

log = logging.getLogger("kvtier.l1")
_POOLS: dict[int, object] = {}


def _with_index(device: torch.device) -> torch.device:
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _kvtier_pool(device: torch.device):  # type: ignore[no-untyped-def]
    """kvtier's dedicated allocator pool on `device` (CUDA with MemPool support), else None.

    One pool per device for the life of the process: every L1Pool shares it, and it is never
    destroyed (destroying a MemPool that still backs cached blocks trips an allocator assert).
    """
    if device.type != "cuda" or not hasattr(torch.cuda, "MemPool"):
        return None
    assert device.index is not None
    if device.index not in _POOLS:
        _POOLS[device.index] = torch.cuda.MemPool()
    return _POOLS[device.index]


@dataclass(eq=False)
class SessionBuffers:
    """One session's L1 KV: ``layers[i] == (K, V)``, each ``[1, H, capacity, D]``.

    `copy` is the last device copy issued from these buffers (the transfer engine's `Handle`
    of an offload), or None: when the buffers are released or replaced while it may still run,
    the cache counts their bytes as in flight until it is done (`kvtier.transfer.inflight`)."""

    layers: list[tuple[torch.Tensor, torch.Tensor]]
    capacity: int
    nbytes: int
    released: bool = field(default=False)
    copy: Any = field(default=None, repr=False)

    @property
    def block(self) -> torch.Tensor | None:
        """The one ``[layer, k|v, 1, H, capacity, D]`` tensor behind `layers`, or None when the
        session got per-layer tensors (no contiguous block was free)."""
        base = self.layers[0][0]._base if self.layers else None  # noqa: SLF001  # torch's view base
        return base if base is not None and base.dim() == 6 else None


class L1Pool:
    """Allocates session buffers within ``budget_bytes``; raises `L1BudgetExceeded` beyond it.

    The pool only accounts and allocates; choosing which idle session to evict when the budget
    is reached is the cache's job (it catches `L1BudgetExceeded`, evicts, and retries).
    """

    def __init__(
        self,
        geometry: KVGeometry,
        budget_bytes: int,
        device: torch.device | str,
        chunk_tokens: int,
    ) -> None:
        if geometry.attention == "mla":
            raise ValueError(
                "L1 buffers hold separate K and V per kv head; MLA latent caches are not "
                "supported by kvtier's L1 yet (use a GQA/MHA/MQA model)"
            )
        if budget_bytes <= 0:
            raise ValueError(f"L1 budget must be positive, got {budget_bytes} bytes")
        self.geometry = geometry
        self.budget_bytes = int(budget_bytes)
        self.device = _with_index(torch.device(device))
        self.chunk_tokens = int(chunk_tokens)
        self.dtype = geometry.torch_dtype()
        self.used_bytes = 0
        self.split_allocations = 0  # sessions given per-layer tensors: no contiguous block fit
        self._lock = threading.Lock()
        self._pool = _kvtier_pool(self.device)

    # -- sizes ---------------------------------------------------------------------------------

    def round_up(self, tokens: int) -> int:
        """Capacity for `tokens`: whole chunks, at least one."""
        c = self.chunk_tokens
        return max(c, -(-tokens // c) * c)

    def bytes_for(self, capacity: int) -> int:
        return self.geometry.bytes_per_token * capacity

    @property
    def free_bytes(self) -> int:
        return self.budget_bytes - self.used_bytes

    def reserved_bytes(self) -> int:
        """Bytes the allocator holds for kvtier's pool (CUDA), or the accounted bytes (CPU)."""
        if self._pool is not None:
            return sum(seg["total_size"] for seg in self._pool.snapshot())
        return self.used_bytes

    def reserve(self) -> None:
        """Claim the whole budget from the CUDA allocator now, for kvtier's pool alone.

        One allocation of `budget_bytes` is made in the pool and freed again: the pool keeps
        the segment, and session buffers are then carved out of it without another cudaMalloc
        (each one synchronizes the device, and under a memory cap it pushes out the model's
        cached blocks). A budget the GPU cannot hold fails here, at start, not mid-turn. A
        no-op on the CPU.
        """
        if self._pool is None:
            return
        try:
            with self._in_pool():
                claim = torch.empty(self.budget_bytes, dtype=torch.uint8, device=self.device)
        except torch.OutOfMemoryError as exc:
            free, _total = torch.cuda.mem_get_info(self.device)
            raise BudgetError(
                f"L1 budget of {self.budget_bytes} bytes does not fit on {self.device} "
                f"({free} bytes free); lower l1_bytes or load a smaller model"
            ) from exc
        del claim

    # -- allocation ----------------------------------------------------------------------------

    @contextlib.contextmanager
    def _in_pool(self) -> Iterator[None]:
        if self._pool is None:
            yield
            return
        with torch.cuda.use_mem_pool(self._pool, device=self.device):
            yield

    def _charge(self, nbytes: int) -> None:
        with self._lock:
            if self.used_bytes + nbytes > self.budget_bytes:
                raise L1BudgetExceeded(
                    f"L1 needs {nbytes} more bytes but only {self.free_bytes} of "
                    f"{self.budget_bytes} are free; evict idle sessions or raise l1_bytes"
                )
            self.used_bytes += nbytes

    def _uncharge(self, nbytes: int) -> None:
        with self._lock:
            self.used_bytes -= nbytes

    def _new_layers(self, capacity: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        g = self.geometry
        v_dim = g.v_head_dim or g.head_dim
        with self._in_pool():
            if v_dim == g.head_dim:  # one allocation, per-layer views (see the module doc)
                try:
                    block = torch.empty(
                        (g.num_layers, 2, 1, g.num_kv_heads, capacity, g.head_dim),
                        dtype=self.dtype,
                        device=self.device,
                    )
                except torch.OutOfMemoryError:
                    # No contiguous free range that big (the pool's free space is split into
                    # smaller segments): per-layer tensors fit into those pieces. The engine
                    # moves them with one copy per layer and plane instead of one per group.
                    self.split_allocations += 1
                    if self.split_allocations == 1:
                        log.info(
                            "L1: no contiguous %d-byte block free on %s; sessions that do not "
                            "fit one get per-layer tensors (slower transfers, same data)",
                            self.bytes_for(capacity),
                            self.device,
                        )
                else:
                    return [(block[i, 0], block[i, 1]) for i in range(g.num_layers)]
            shape_k = (1, g.num_kv_heads, capacity, g.head_dim)
            shape_v = (1, g.num_kv_heads, capacity, v_dim)
            return [
                (
                    torch.empty(shape_k, dtype=self.dtype, device=self.device),
                    torch.empty(shape_v, dtype=self.dtype, device=self.device),
                )
                for _ in range(g.num_layers)
            ]

    def _charged_layers(self, tokens: int) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], int]:
        """New per-layer buffers for `tokens` (whole chunks), charged to the budget."""
        nbytes = self.bytes_for(self.round_up(tokens))
        self._charge(nbytes)
        try:
            return self._new_layers(self.round_up(tokens)), nbytes
        except BaseException:
            self._uncharge(nbytes)
            raise

    def allocate(self, tokens: int) -> SessionBuffers:
        """Buffers with room for at least `tokens` tokens (rounded up to whole chunks)."""
        layers, nbytes = self._charged_layers(tokens)
        return SessionBuffers(layers=layers, capacity=self.round_up(tokens), nbytes=nbytes)

    def grow(self, bufs: SessionBuffers, tokens: int, keep: int) -> None:
        """Make room for `tokens`, keeping the first `keep` tokens; in place on `bufs`.

        Growth is by whole chunks. The old and new buffers coexist for the copy, so the budget
        must cover both for that moment.
        """
        if tokens <= bufs.capacity:
            return
        layers, nbytes = self._charged_layers(tokens)
        new_block, old_block = block_of(layers), block_of(bufs.layers)
        if new_block is not None and old_block is not None:  # one copy for every layer
            new_block[..., :keep, :].copy_(old_block[..., :keep, :])
        else:
            for (k_new, v_new), (k_old, v_old) in zip(layers, bufs.layers, strict=True):
                k_new[:, :, :keep].copy_(k_old[:, :, :keep])
                v_new[:, :, :keep].copy_(v_old[:, :, :keep])
        old_bytes = bufs.nbytes
        bufs.layers, bufs.capacity, bufs.nbytes = layers, self.round_up(tokens), nbytes
        self._uncharge(old_bytes)

    def release(self, bufs: SessionBuffers) -> None:
        """Return a session's buffers. Safe to call twice."""
        if bufs.released:
            return
        bufs.released = True
        bufs.layers = []
        bufs.copy = None
        self._uncharge(bufs.nbytes)


def block_of(layers: Sequence[Sequence[torch.Tensor]]) -> torch.Tensor | None:
    """The one ``[layer, k|v, 1, H, capacity, D]`` tensor whose views ``[i, 0]`` and ``[i, 1]``
    are layer i's K and V (as `L1Pool` allocates them), or None for any other layout."""
    if not layers:
        return None
    base = layers[0][0]._base  # noqa: SLF001  # torch's view base (no public getter)
    if base is None or base.dim() != 6 or base.shape[0] != len(layers) or base.shape[2] != 1:
        return None
    offset, (s0, s1) = base.storage_offset(), base.stride()[:2]
    for i, pair in enumerate(layers):
        for j, t in enumerate(pair[:2]):
            if (
                t._base is not base  # noqa: SLF001
                or t.storage_offset() != offset + i * s0 + j * s1
                or t.shape != base.shape[2:]
                or t.stride() != base.stride()[2:]
            ):
                return None
    return base
