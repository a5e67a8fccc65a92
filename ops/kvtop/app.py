"""kvtop entry point."""

from __future__ import annotations

import click


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--url",
    default="http://127.0.0.1:8000",
    show_default=True,
    help="Base URL of a kvtier serve or kvtier exporter.",
)
@click.option("--interval", default=1.0, show_default=True, help="Refresh period in seconds.")
def main(url: str, interval: float) -> None:
    """Live terminal view of kvtier's tiers, sessions and host signals."""
    raise click.ClickException("kvtop's screen is not built yet in this version")
