"""Completion handles and staging buffers of the device mover (kvtier.transfer.device).

A `Handle` is one GPU<->host transfer's completion: a blocking-sync CUDA event that also
times the transfer, or nothing to wait for on a CPU device. A `_Stage` is one staging buffer
of `group_chunks` chunks (plus encoded payload rows for a quantizing codec on the GPU), with
the events that order its producer and consumer streams.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from kvtier.transfer.device import DeviceMover

_ALIGN = 256  # staging rows start on this many bytes (scales are read as float32)
# Per thread and device: the stream `Handle.wait(spin)` syncs. One per thread, since a stream's
# synchronize waits for everything queued on it: with one per device, a restore thread would
# also wait for the copies other threads queued there before it.
_WAITERS = threading.local()


def _done_event() -> torch.cuda.Event:
    """The event a transfer's Handle waits on: it also times the transfer, and it is blocking
    (cudaEventBlockingSync), so a host thread in `wait` (an L3 writer before it writes the
    slot, a caller) sleeps until the copy is done instead of spinning on the driver while the
    decode loop launches kernels. Events only waited on by streams stay non-blocking."""
    return torch.cuda.Event(enable_timing=True, blocking=True)


class Handle:
    """Completion of one GPU<->host transfer: a CUDA event, or nothing left to wait for on CPU."""

    __slots__ = ("_device", "_event", "_keep", "direction")

    def __init__(
        self,
        event: torch.cuda.Event | None = None,
        keep: Any = None,
        direction: tuple[str, str] | None = None,
        device: torch.device | None = None,
    ) -> None:
        self._event = event
        self._device = device  # the event's device (CUDA)
        self._keep = keep  # tensors the copy reads or writes stay alive until it is done
        self.direction = direction

    def done(self) -> bool:
        if self._event is None or self._event.query():
            self._keep = None
            return True
        return False

    def wait(self, spin: bool = False) -> None:
        """Block the calling thread until the copy has finished.

        By default the thread sleeps in the driver (the event is blocking-sync), the right
        wait for a background thread. `spin=True` is for the serving thread when it needs the
        result at once (a restore before the forward): it syncs a side stream that waits on
        the event, which with CUDA's default scheduling spins (the GIL released) and returns
        about 0.2 ms sooner than waking from the blocking event on the H200.
        """
        event = self._event
        if event is not None:
            if spin and self._device is not None:
                index = self._device.index or 0
                mine = _WAITERS.__dict__.setdefault("streams", {})
                waiter = mine.get(index)
                if waiter is None:
                    waiter = mine[index] = torch.cuda.Stream(self._device)
                waiter.wait_event(event)
                waiter.synchronize()
            else:
                event.synchronize()
        self._keep = None

    def wait_stream(self, stream: torch.cuda.Stream | None = None) -> None:
        """Make `stream` (default: the current one) wait for the copy, without blocking the host."""
        if self._event is not None:
            (stream or torch.cuda.current_stream(self._device)).wait_event(self._event)


class _Stage:
    """One staging buffer: `group` chunks in the model dtype, plus encoded payload rows for a
    quantizing codec on the GPU. `ready` marks the end of its producer, `free` of its consumer.
    `scratch` is the codec's float32 work buffer, shared by the stages of one direction (one
    stream runs all their encodes, or decodes, one after another)."""

    def __init__(self, engine: DeviceMover, rows: bool, scratch: torch.Tensor | None) -> None:
        g = engine.geometry
        self.geometry = g
        self.chunk_elems = g.chunk_bytes(engine.chunk_tokens) // g.element_size
        self.chunks = torch.empty(
            engine.group_chunks * self.chunk_elems, dtype=g.torch_dtype(), device=engine.device
        )
        self.row_bytes = -(-engine.codec.payload_bytes(engine.chunk_tokens) // _ALIGN) * _ALIGN
        self.rows = (
            torch.empty(
                engine.group_chunks * self.row_bytes, dtype=torch.uint8, device=engine.device
            )
            if rows
            else None
        )
        self.scratch = scratch
        self.ready: Any = torch.cuda.Event() if engine.cuda else None
        self.free: Any = torch.cuda.Event() if engine.cuda else None
        self._views: dict[tuple[int, int, bool], list[torch.Tensor]] = {}

    @property
    def nbytes(self) -> int:
        """Bytes of this stage's own buffers (the shared scratch is counted by the engine)."""
        rows = 0 if self.rows is None else self.rows.numel()
        return self.chunks.numel() * self.chunks.element_size() + rows

    def staged(self, count: int, length: int) -> torch.Tensor:
        """The first `count` chunks of `length` tokens: [count, L, P, length, H, D]."""
        shape = self.geometry.chunk_shape(length)
        elems = self.geometry.chunk_bytes(length) // self.geometry.element_size
        return self.chunks[: count * elems].view(count, *shape)

    def payload(self, index: int, length: int, size: int) -> torch.Tensor:
        """Where chunk `index` of a group of `length`-token chunks is encoded (`size` bytes)."""
        if self.rows is not None:
            return self.rows[index * self.row_bytes : index * self.row_bytes + size]
        nbytes = self.geometry.chunk_bytes(length)
        return self.chunks.view(torch.uint8)[index * nbytes : index * nbytes + size]

    def planes(self, count: int, length: int, fused: bool) -> list[torch.Tensor]:
        """The group as `_planes` gives it (views cached per shape)."""
        key = (count, length, fused)
        views = self._views.get(key)
        if views is None:
            if len(self._views) > 64:
                self._views.clear()
            views = _planes(self.staged(count, length), fused)
            self._views[key] = views
        return views


def _planes(staged: torch.Tensor, fused: bool) -> list[torch.Tensor]:
    """[count, L, P, n, H, D] as `_l1_views` lays out L1: one view [L*P, H, count, n, D] when
    fused, else L*P views [H, count, n, D], layer-major."""
    planes = staged.permute(1, 2, 4, 0, 3, 5).flatten(0, 1)
    return [planes] if fused else list(planes.unbind(0))


def _copy_all(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    """dst[i].copy_(src[i]) for all i, in one call where torch offers it (less launch overhead)."""
    if len(dst) == 1:
        dst[0].copy_(src[0])
        return
    foreach = getattr(torch, "_foreach_copy_", None)
    if foreach is not None:
        foreach(dst, src)
        return
    for d, s in zip(dst, src, strict=True):
        d.copy_(s)
