"""Device faults that lose the process's CUDA context, after which no request can succeed.

A device-side assert (an index past a table, such as a token id past the embeddings) or an
illegal memory access leaves the CUDA context unusable: every later call on the device fails,
until the process exits. Caught per request like any other error, such a fault left a server
that answered 500 to everything while /readyz said ready. The engine instead marks itself failed
on the first one (`Engine.device_fault`): /readyz answers 503 with the reason, and the server
exits non-zero so that its supervisor starts a fresh process (sessions stored in L3 are found
again). Running out of device memory is not such a fault: the request fails, the next may fit.
A model placed across devices has its own answer to a lost device (kvtier.server.devices.failover).
"""

from __future__ import annotations

import torch

from kvtier.errors import KvtierError

# What torch's messages say of a fault that loses the context (before torch.AcceleratorError,
# a CUDA error came as a plain RuntimeError)
_LOST_CONTEXT = ("CUDA error", "device-side assert", "illegal memory access")
# ...except running out of memory (a library's allocation can say "CUDA error: out of memory")
_RECOVERABLE = ("out of memory",)


class DeviceFault(KvtierError):
    """The device's CUDA context is lost: the server stops and exits non-zero."""

    @classmethod
    def of(cls, exc: BaseException) -> DeviceFault:
        # the first line: torch adds lines of debugging advice (CUDA_LAUNCH_BLOCKING=1, ...)
        first = (str(exc).strip().splitlines() or [""])[0]
        return cls(
            f"the device failed ({type(exc).__name__}: {first}) and no later call on it can "
            "succeed; restart the server (its supervisor does, on this non-zero exit)"
        )


def is_fatal_device_error(exc: BaseException) -> bool:
    """Whether `exc` (or an error it was raised from) lost the CUDA context; never for
    torch.OutOfMemoryError, which leaves the device usable."""
    seen = 0
    cause: BaseException | None = exc
    while cause is not None and seen < 8:  # a bounded walk: a cycle of causes ends too
        if _lost_context(cause):
            return True
        cause, seen = cause.__cause__, seen + 1
    return False


def _lost_context(exc: BaseException) -> bool:
    if isinstance(exc, (torch.OutOfMemoryError, KvtierError)) or not isinstance(exc, RuntimeError):
        return False
    text = str(exc)
    if any(marker in text for marker in _RECOVERABLE):
        return False
    accelerator = getattr(torch, "AcceleratorError", None)  # torch 2.8 and later
    if accelerator is not None and isinstance(exc, accelerator):
        return True
    return any(marker in text for marker in _LOST_CONTEXT)
