"""The interpreter's settings while a batch scheduler runs: its GIL switch interval, and on the
CPU the intra-op threads torch may use."""

from __future__ import annotations

import os
import sys
from typing import Any

import torch

# The interpreter's GIL switch interval while a scheduler runs (Python's default: 5 ms). Every
# torch call of the scheduler thread releases the GIL and takes it back, and the restore,
# commit and event-loop threads run Python meanwhile: at 5 ms one step's dozen calls could wait
# longer than the step (docs/architecture.md, "The GIL").
SWITCH_INTERVAL_S = 0.0005


def tune_interpreter(config: Any, device: torch.device) -> float:
    """Set the switch interval (`switch_interval_s`) and, on the CPU, leave a core to the event
    loop (HTTP, streaming): on 2 cores, 16 sessions decoded 2.2x faster with one intra-op
    thread than with two (docs/architecture.md). Returns the interval to give back at close."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(float(getattr(config, "switch_interval_s", SWITCH_INTERVAL_S)))
    if device.type == "cpu":
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 2
        torch.set_num_threads(max(1, min(torch.get_num_threads(), cores - 1)))
    return before
