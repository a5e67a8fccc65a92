"""The option names every command shares, so that one setting has one flag everywhere.

`--l3-root` names the L3 store in `serve`, `doctor`, `exporter`, `kvtop` and `kvtier l3 ...`;
`--l3-cold-root` its cold tier; `--l2-bytes` the L2 size. An older spelling (`--root`,
`--cold-dir`, `--l2-size`) still works as a hidden alias: accepted, but neither `--help` nor an
error message shows it.
"""

from __future__ import annotations

from typing import Any

import click


class AliasedOption(click.Option):
    """An option whose names after the first are old spellings: accepted, never shown."""

    def get_help_record(self, ctx: click.Context) -> tuple[str, str] | None:
        shown, self.opts = self.opts, self.opts[:1]
        try:
            return super().get_help_record(ctx)
        finally:
            self.opts = shown

    def get_error_hint(self, ctx: click.Context | None) -> str:
        return f"'{self.opts[0]}'"


def aliased_option(*decls: str, **attrs: Any) -> Any:
    """`click.option` whose later flag names are hidden aliases of the first."""
    return click.option(*decls, cls=AliasedOption, **attrs)
