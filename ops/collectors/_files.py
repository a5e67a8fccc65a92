"""Small file helpers shared by the readers: a missing or unreadable file is None, never an error."""

from __future__ import annotations

import os


def read_text(path: str) -> str | None:
    """The whole file as text, or None when it is missing or unreadable (permissions, EIO)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return None


def read_attr(directory: str, name: str) -> str | None:
    """One sysfs attribute, stripped; None when missing."""
    text = read_text(os.path.join(directory, name))
    return None if text is None else text.strip()
