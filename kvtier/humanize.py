"""Numbers as people read them in the CLI's text output: counts with their noun, binary sizes."""

from __future__ import annotations

_IRREGULAR = {"entry": "entries", "query": "queries"}


def plural(n: int | float, noun: str, many: str | None = None) -> str:
    """'1 chunk', '2 chunks', '0 chunks'; `many` for an irregular plural."""
    if n == 1:
        return f"{n:g} {noun}" if isinstance(n, float) else f"{n} {noun}"
    word = many or _IRREGULAR.get(noun) or (noun + ("es" if noun.endswith(("s", "x")) else "s"))
    return f"{n:g} {word}" if isinstance(n, float) else f"{n} {word}"


def size(n: float) -> str:
    """Bytes in binary units: '512 B', '14.0 MiB', '1.5 GiB'."""
    if abs(n) < 1024:
        return f"{int(n)} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024
        if abs(n) < 1024 or unit == "TiB":
            break
    return f"{n:.1f} {unit}"
