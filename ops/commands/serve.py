"""`kvtier serve`: the OpenAI-compatible server, with the cache's metrics on its /metrics.

This command lives in ops because it wires ops.exporter's collectors into the server's registry;
kvtier.server takes the registry as an argument and never imports ops.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import click
from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from kvtier.errors import ConfigError
from kvtier.server.run import banner, load_config, options, run_app
from ops.exporter.cache import families, l3_up
from ops.exporter.registry import HostCollector, register_process


class _LiveCache(Collector):
    """The running server's cache snapshot at every scrape (nothing before the model loads)."""

    def __init__(self, state: Any) -> None:
        self._state = state

    def collect(self) -> Iterator[Metric]:
        snap = self._state.snapshot()
        if snap is not None:
            yield from families(snap)
        elif self._state.config.cache == "tiered":
            yield l3_up(False)  # loading, or the cache failed to open its L3 root

    def describe(self) -> Iterator[Metric]:
        return iter(())


@click.command("serve", context_settings={"help_option_names": ["-h", "--help"]})
@options
def command(**flags: Any) -> None:
    """OpenAI-compatible server with the tiered KV cache (chat + completions, streaming).

    \b
    kvtier serve --host 127.0.0.1 --port 8000 --l3-root DIR [--model PATH]
    Settings: flags > KVTIER_* environment > TOML ([serve] table); see docs/configuration.md.
    """
    try:  # before the server's modules (torch) are imported: a bad setting is refused at once
        config = load_config(flags)
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from None
    from kvtier.server.http.app import create_app

    registry = CollectorRegistry()
    app = create_app(config, registry=registry)
    registry.register(_LiveCache(app.state.kvtier))
    registry.register(HostCollector(config.l3_root))  # host signals next to the cache's
    register_process(registry, config.l3_root)  # RSS, CPU, threads, open L3 files
    run_app(app, config, announce=banner(config))
