"""The `kvtier` console script: the cache's commands plus the operations commands.

The entry point lives in ops because it composes both packages: kvtier must never import ops,
so the wiring that needs both (serve with host metrics, doctor, exporter) sits here.

The ops commands (and `keys`) are loaded lazily: `kvtier --help` lists them from the table
below, and only the command that runs is imported. `serve` pulls in torch, transformers and
fastapi (seconds); nothing else should pay for that, `--help` least of all.
"""

from __future__ import annotations

import importlib
from typing import Any

import click

from kvtier.cli import cli

# name -> (module defining `command`, the one-line help `kvtier --help` shows without importing
# it). tests/ops/test_cli_startup.py checks each line against the command's own help.
LAZY: dict[str, tuple[str, str]] = {
    "doctor": (
        "ops.commands.doctor",
        "Check this host against the recommended tuning (the values the Ansible role applies).",
    ),
    "exporter": (
        "ops.commands.exporter",
        "Standalone Prometheus exporter for a host whose cache runs elsewhere.",
    ),
    "serve": (
        "ops.commands.serve",
        "OpenAI-compatible server with the tiered KV cache (chat + completions, streaming).",
    ),
    "keys": (
        "kvtier.cli.keys",
        "Create, list and revoke API keys (the server's tenants and admins).",
    ),
}


class LazyCommand(click.Command):
    """A subcommand listed by name and one-line help; its module is imported when it runs.

    The group resolves the name to this object, then calls `make_context`, which hands over to
    the real command: from there on click sees only the real one (its options, help, invoke).
    """

    def __init__(self, name: str, module: str, line: str) -> None:
        # `help`, not `short_help`: click shortens it for the listing as it does a docstring
        super().__init__(name, help=line, add_help_option=False)
        self.module = module

    def load(self) -> click.Command:
        command = importlib.import_module(self.module).command
        assert isinstance(command, click.Command)
        return command

    def make_context(
        self,
        info_name: str | None,
        args: list[str],
        parent: click.Context | None = None,
        **extra: Any,
    ) -> click.Context:
        return self.load().make_context(info_name, args, parent=parent, **extra)


def _register_ops(group: click.Group) -> None:
    for name, (module, line) in LAZY.items():
        group.add_command(LazyCommand(name, module, line))


_register_ops(cli)


def main() -> None:
    cli(prog_name="kvtier")


if __name__ == "__main__":
    main()
