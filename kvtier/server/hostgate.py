"""The helper gate: restore and commit threads start their work while the scheduler waits.

The batch scheduler's thread launches each step from Python, one torch call after another,
and every torch call gives the GIL up and takes it back. While the restore and commit threads
run Python too, each of those calls can wait for a helper to let the GIL go (up to the switch
interval), and the GPU runs dry before the next step is launched: on an H200 the slowest tenth
of the 256-session fleet's steps took about twice the typical one, host-paced.

With the gate on (`helper_gate_ms` > 0), the scheduler closes it while it works on the host
and opens it while it waits: for the GPU's tokens, or for work. A helper passes the gate before
each job (a restore, a commit), so jobs start inside those waits, and waits at most
`helper_gate_ms` when the gate stays closed: a helper is delayed, never stalled, and the
scheduler never waits for the gate. A job already running runs on. Off (0), `pass_` returns at
once and the scheduler's calls cost one attribute test.
"""

from __future__ import annotations

import threading


class HostGate:
    def __init__(self, max_wait_ms: float = 0.0) -> None:
        if max_wait_ms < 0:
            raise ValueError(f"helper_gate_ms: must not be negative, got {max_wait_ms}")
        self.enabled = max_wait_ms > 0
        self.max_wait = max_wait_ms / 1000
        self._open = threading.Event()
        self._open.set()
        self.waited = 0  # passes that found the gate closed (read by the bench)

    def close(self) -> None:
        """The scheduler works on the host from now on."""
        if self.enabled:
            self._open.clear()

    def open(self) -> None:
        """The scheduler waits from now on (for the GPU, or for work)."""
        if self.enabled:
            self._open.set()

    def pass_(self) -> None:
        """A helper, before a job: wait while the gate is closed, at most `max_wait`."""
        if self.enabled and not self._open.is_set():
            self.waited += 1
            self._open.wait(self.max_wait)
