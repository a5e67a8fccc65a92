"""`kvtier loadgen`: drive a server with a fleet of agent sessions and report latency."""

from __future__ import annotations

import json
from pathlib import Path

import click


@click.command("loadgen", context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--url",
    "urls",
    multiple=True,
    default=("http://127.0.0.1:8000",),
    show_default=True,
    help="A server's base URL. Give it again for more servers: each session's turns then go "
    "round them (turn t of session i to server (i + t) mod n), as a load balancer without "
    "affinity would send them.",
)
@click.option("--sessions", default=100, show_default=True, help="Concurrent agent sessions.")
@click.option("--turns", default=10, show_default=True, help="Turns per session.")
@click.option("--think-ms", default=2000.0, show_default=True, help="Mean tool-call pause.")
@click.option("--max-tokens", default=32, show_default=True, help="Reply length per turn.")
@click.option(
    "--ignore-eos",
    is_flag=True,
    help="Ask every reply to run to --max-tokens: the end-of-sequence token ends none (the "
    "server's ignore_eos request field). For benchmarks that need fixed-length replies, e.g. "
    "to compare tok/s with an in-process run that decodes a fixed count per turn.",
)
@click.option(
    "--system-chars",
    default=3000,
    show_default=True,
    help="The system prompt's size in characters, shared by every session.",
)
@click.option(
    "--user-chars", default=200, show_default=True, help="Each user message's size in characters."
)
@click.option(
    "--tool-chars", default=400, show_default=True, help="Each tool result's size in characters."
)
@click.option("--duration", type=float, help="Stop starting turns after this many seconds.")
@click.option("--ramp", type=float, help="Spread session starts over seconds (default think).")
@click.option(
    "--model",
    default="default",
    show_default=True,
    help="The model name sent with each request (the server's --served-model-name).",
)
@click.option(
    "--tenant",
    default="loadgen",
    show_default=True,
    help="The tenant every session runs under, sent as X-Tenant (not with --api-key).",
)
@click.option(
    "--api-key",
    envvar="KVTIER_API_KEY",
    help="Send `Authorization: Bearer KEY` (a server with --api-keys; also KVTIER_API_KEY). The "
    "key names the tenant, so --tenant is not sent; the recompute probes then put a nonce at "
    "the start of the prompt instead of using a fresh tenant; --hibernate-during-tools needs "
    "an admin key.",
)
@click.option(
    "--seed",
    default=0,
    show_default=True,
    help="Seed of the prompts' text and the pauses: the same seed sends the same load.",
)
@click.option("--hibernate-during-tools", is_flag=True, help="POST hibernate at each pause.")
@click.option("--compare", default=8, show_default=True, help="Restore vs recompute probes.")
@click.option(
    "--out",
    type=click.Path(dir_okay=False, path_type=Path),
    default="loadgen.json",
    show_default=True,
    help="JSON result.",
)
@click.option(
    "--png",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Plot of TTFT by restore source (default: beside --out, named as it with .png).",
)
def command(out: Path, png: Path | None, urls: tuple[str, ...], **opts: object) -> None:
    """A fleet of agent sessions: growing conversations, tool-call pauses, shared system prompt.

    Reports TTFT and inter-token latency P50/P95/P99 overall and by restore source, errors and
    throughput; writes a JSON result and a PNG plot. With several --url, also each server's
    requests by restore source and hits by tier.

    An agent whose next turn would not fit the servers' max_model_len (their /v1/models) starts
    its conversation over in a new session, as an agent framework does; refusals are counted
    by their error code (e.g. `http 400 context_length_exceeded`).
    """
    from kvtier.loadgen import LoadConfig, format_report, plot, run

    if len(set(urls)) != len(urls):
        raise click.BadParameter("the same --url twice", param_hint="--url")
    hosts = {"url": urls[0], "urls": urls if len(urls) > 1 else ()}
    config = LoadConfig(**hosts, **opts)  # type: ignore[arg-type]
    if config.sessions < 1 or config.turns < 1:
        raise click.BadParameter("--sessions and --turns must be at least 1")
    png = png or out.with_suffix(".png")
    result = run(config)
    out.write_text(json.dumps(result, indent=1))
    plot(result, png)
    click.echo(format_report(result))
    click.echo(f"\nresult: {out}  plot: {png}")
    if result["ok"] == 0:
        raise SystemExit(1)
