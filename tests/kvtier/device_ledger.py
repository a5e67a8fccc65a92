"""A ledger of the live bytes the serving path creates on its device, for the budget tests.

`DeviceLedger` is a `TorchFunctionMode` entered in every thread started while it is armed (the
scheduler's thread, its commit, restore and loader threads: modes are per thread). It sees
every torch function and tensor method those threads call, and counts each tensor returned
whose storage is new: not an input's (a view, an in-place op, an `out=` buffer). (A dispatch
mode would see the kernels' outputs one level lower, but it breaks tensor subclasses that
attention builds, such as `CausalBias`.) A storage stays counted until it is freed
(a weak reference's finalizer), so `peak` is the most bytes the serving path held at once
beyond what existed before it ran (weights, the page pool, L2).

On a CPU-only machine the serving device is the CPU, and so is every host buffer: the ledger
counts what the serving threads make on `device`, wherever it is meant to live.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves


class DeviceLedger(TorchFunctionMode):
    def __init__(self, device: str = "cpu") -> None:
        super().__init__()
        self.device = torch.device(device)
        self._lock = threading.Lock()
        self._live: dict[int, int] = {}  # storage data_ptr -> bytes
        self.live = 0
        self.peak = 0
        self.made = 0  # storages counted, in all
        self.largest: list[tuple[int, str, str]] = []  # (bytes, op, thread) of the largest

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = {
            t.untyped_storage().data_ptr()
            for t in tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor) and t.device == self.device
        }
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device == self.device:
                self._count(t, inputs, str(func))
        return out

    def _count(self, t: torch.Tensor, inputs: set[int], op: str) -> None:
        storage = t.untyped_storage()
        ptr, nbytes = storage.data_ptr(), storage.nbytes()
        if ptr in inputs or nbytes == 0:
            return
        with self._lock:
            if ptr in self._live:
                return
            self._live[ptr] = nbytes
            self.live += nbytes
            self.made += 1
            self.peak = max(self.peak, self.live)
            self.largest = sorted(
                [*self.largest, (nbytes, op, threading.current_thread().name)], reverse=True
            )[:5]
        weakref.finalize(storage, self._freed, ptr)

    def _freed(self, ptr: int) -> None:
        with self._lock:
            self.live -= self._live.pop(ptr, 0)


@contextmanager
def armed(ledger: DeviceLedger) -> Iterator[DeviceLedger]:
    """Every thread started inside runs its work under `ledger`."""
    start_run = threading.Thread.run

    def run(self: threading.Thread) -> None:
        with ledger:
            start_run(self)

    threading.Thread.run = run  # type: ignore[method-assign]
    try:
        yield ledger
    finally:
        threading.Thread.run = start_run  # type: ignore[method-assign]
