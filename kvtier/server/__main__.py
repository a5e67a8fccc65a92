"""`python -m kvtier.server`: the server without the ops toolkit (cache metrics only)."""

from __future__ import annotations

from typing import Any

import click

from kvtier.errors import ConfigError
from kvtier.server.run import load_config, options, serve


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@options
def main(**flags: Any) -> None:
    """OpenAI-compatible server with the tiered KV cache."""
    try:
        config = load_config(flags)
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from None
    serve(config)


if __name__ == "__main__":
    main()
