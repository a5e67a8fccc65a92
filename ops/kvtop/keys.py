"""Keyboard input: stdin in cbreak mode, read by a daemon thread into a queue.

cbreak (not raw) keeps Ctrl-C working; the terminal settings are restored on exit, even after
an exception. Without a terminal on stdin (a pipe, a test) no thread starts.
"""

from __future__ import annotations

import os
import queue
import select
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


@contextmanager
def keyboard(events: queue.Queue[tuple[str, Any]]) -> Iterator[bool]:
    """Put ("key", ch) on `events` for every key pressed; yields whether keys are read."""
    if not sys.stdin.isatty():
        yield False
        return
    import termios
    import tty

    fd = sys.stdin.fileno()
    saved = termios.tcgetattr(fd)
    stop = threading.Event()

    def read() -> None:
        while not stop.is_set():
            ready, _, _ = select.select([fd], [], [], 0.1)
            if not ready:
                continue
            data = os.read(fd, 32)
            if not data:
                return
            for ch in data.decode("utf-8", "replace"):
                events.put(("key", ch))

    tty.setcbreak(fd)
    thread = threading.Thread(target=read, name="kvtop-keys", daemon=True)
    thread.start()
    try:
        yield True
    finally:
        stop.set()
        thread.join(timeout=0.5)
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)
