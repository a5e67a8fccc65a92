"""/proc/pressure/{memory,io,cpu}: pressure stall information (PSI, Linux >= 4.20).

`some` is the share of time at least one task stalled on the resource, `full` the share when
all non-idle tasks stalled. The system-wide cpu file gained a `full` line in 5.13 (always zero
there). avg10/60/300 are percentages; total is cumulative microseconds.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Stall:
    """One PSI line: averages as ratios 0..1 and the total stall time in seconds."""

    avg10: float
    avg60: float
    avg300: float
    total_seconds: float


@dataclass(frozen=True)
class Pressure:
    """The `some` and `full` lines of one resource (None where the kernel prints no line)."""

    some: Stall | None
    full: Stall | None


def _stall(fields: list[str]) -> Stall | None:
    values: dict[str, str] = {}
    for item in fields:
        key, sep, value = item.partition("=")
        if sep:
            values[key] = value
    try:
        return Stall(
            avg10=round(float(values["avg10"]) / 100, 6),
            avg60=round(float(values["avg60"]) / 100, 6),
            avg300=round(float(values["avg300"]) / 100, 6),
            total_seconds=int(values["total"]) / 1e6,
        )
    except (KeyError, ValueError):
        return None


def parse(text: str) -> Pressure:
    """Parse one /proc/pressure/<resource> file."""
    lines: dict[str, Stall | None] = {}
    for line in text.splitlines():
        parts = line.split()
        if parts and parts[0] in ("some", "full"):
            lines[parts[0]] = _stall(parts[1:])
    return Pressure(some=lines.get("some"), full=lines.get("full"))
