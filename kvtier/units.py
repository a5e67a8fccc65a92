"""Sizes in bytes, read one way everywhere (serve, plan, doctor, `l3 gc`, TOML and environment).

A size is a number with an optional unit, case-insensitive, spaces allowed around it:

- no unit or `B`: bytes
- `K`, `M`, `G`, `T` (also `KB`, `MB`, `GB`, `TB`): decimal SI, powers of 1000 (`2G` = 2,000,000,000)
- `Ki`, `Mi`, `Gi`, `Ti` (also `KiB`, `MiB`, `GiB`, `TiB`): binary, powers of 1024
  (`2Gi` = 2,147,483,648)

Fractions are allowed (`1.5GB`); the result is rounded down to whole bytes. Anything else
(a negative number, hex, `inf`, an unknown unit) raises `SizeError`, which lists these forms.
"""

from __future__ import annotations

import math
import re

from kvtier.errors import ConfigError

_UNITS: dict[str, int] = {"": 1, "b": 1}
for _i, _p in enumerate("kmgt", start=1):
    _UNITS[_p] = _UNITS[_p + "b"] = 1000**_i
    _UNITS[_p + "i"] = _UNITS[_p + "ib"] = 1024**_i

_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([a-zA-Z]*)\s*$")

FORMS = (
    "a number of bytes with an optional unit: K/M/G/T (or KB/MB/GB/TB) are powers of 1000, "
    "Ki/Mi/Gi/Ti (or KiB/MiB/GiB/TiB) powers of 1024; e.g. 4096, 512MiB, 24GiB or 1.5GB"
)


class SizeError(ConfigError):
    """A size could not be read; the message names the setting and the accepted forms.
    `reason` is the message without the setting's name (a command-line error names it)."""

    def __init__(self, name: str, reason: str) -> None:
        super().__init__(f"{name}: {reason}")
        self.reason = reason


def parse_size(text: str | int, name: str = "size") -> int:
    """Bytes from `4096`, `512MiB`, `2G` (decimal), `2Gi` (binary), `1.5GB`; see the module doc.

    `name` is the setting the text came from, for the error message.
    """
    if isinstance(text, bool):
        raise SizeError(name, f"{text!r} is not a size; write {FORMS}")
    if isinstance(text, int):
        if text < 0:
            raise SizeError(name, f"{text} is negative; give a byte count >= 0")
        return text
    match = _SIZE.match(str(text))
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        raise SizeError(name, f"cannot read size {text!r}; write {FORMS}")
    value = float(match.group(1)) * _UNITS[unit]
    if not math.isfinite(value):
        raise SizeError(name, f"{text!r} is not a finite number of bytes; write {FORMS}")
    return int(value)


def size_arg(text: str, name: str) -> int:
    """`parse_size` for a command-line option: a bad size is a usage error (exit 2, no
    traceback) naming the option once, in the words of every command's:
    `Invalid value for '--l2-bytes': cannot read size '12XB'; write ...`."""
    import click

    try:
        return parse_size(text, name)
    except SizeError as exc:
        raise click.BadParameter(exc.reason, param_hint=f"'{name}'") from None


def size_option(ctx: object, param: object, value: str | None) -> int | None:
    """A click callback reading an option's value with `size_arg` (None: not given)."""
    if value is None:
        return None
    return size_arg(value, getattr(param, "opts", ["size"])[0])
