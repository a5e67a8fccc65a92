"""The `kvtier` command group for the cache itself (the ops commands are added in ops.cli)."""

from __future__ import annotations

import click

from kvtier import __version__


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="kvtier")
def cli() -> None:
    """kvtier: keep every agent session's KV cache in the right tier (GPU, host RAM, SSD).

    \b
    Main job:   kvtier serve            OpenAI-compatible server with the tiered cache
    Load:       kvtier loadgen          a fleet of agent sessions against a server
                kvtier replay TRACE     a request trace against a server
    Planning:   kvtier plan             how many sessions fit in each tier
    Fleet:      kvtier fleet ...        HAProxy in front of several hosts
    Storage:    kvtier l3 ...           inspect, check and maintain the SSD tier
    Access:     kvtier keys ...         API keys of the server's tenants and admins
    Host:       kvtier doctor           check this host against the recommended tuning
    Metrics:    kvtier exporter         standalone Prometheus exporter
    """


def register(group: click.Group) -> None:
    """Attach the cache's subcommands. Each lives in its own module to keep modules small."""
    from kvtier.cli import fleet, l3, loadgen, plan, replay

    for module in (l3, plan, loadgen, replay, fleet):
        group.add_command(module.command)


register(cli)
