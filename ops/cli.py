"""The `kvtier` console script: the cache's commands plus the operations commands.

The entry point lives in ops because it composes both packages: kvtier must never import ops,
so the wiring that needs both (serve with host metrics, doctor, exporter) sits here.
"""

from __future__ import annotations

import click

from kvtier.cli import cli


def _register_ops(group: click.Group) -> None:
    from ops.commands import doctor, exporter, serve

    for module in (doctor, exporter, serve):
        group.add_command(module.command)


_register_ops(cli)


def main() -> None:
    cli(prog_name="kvtier")


if __name__ == "__main__":
    main()
