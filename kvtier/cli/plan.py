"""`kvtier plan`: how many sessions fit in each tier, and the L1/L2/L3 sizes to configure."""

from __future__ import annotations

import json
from pathlib import Path

import click

from kvtier.errors import ConfigError
from kvtier.geometry import KVGeometry
from kvtier.units import parse_size


def _fmt(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


@click.command("plan")
@click.option(
    "--model-config",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    required=True,
    help="the model's config.json",
)
@click.option("--sessions", type=int, default=100, show_default=True, help="sessions to keep alive")
@click.option(
    "--avg-tokens", type=int, default=3000, show_default=True, help="average tokens per session"
)
@click.option(
    "--gpu-mem", default="24GiB", show_default=True, help="GPU memory for the KV cache (L1)"
)
@click.option("--host-mem", default="64GiB", show_default=True, help="host RAM for L2")
@click.option("--ssd", default="1TiB", show_default=True, help="SSD space for L3")
@click.option("--dtype", default=None, help="KV dtype (default: the config's)")
@click.option("--chunk-tokens", type=int, default=256, show_default=True)
def command(
    model_config: Path,
    sessions: int,
    avg_tokens: int,
    gpu_mem: str,
    host_mem: str,
    ssd: str,
    dtype: str | None,
    chunk_tokens: int,
) -> None:
    """Print bytes per token, sessions per tier and the sizes to configure."""
    try:
        config = json.loads(model_config.read_text())
    except json.JSONDecodeError as exc:
        raise click.BadParameter(
            f"{model_config} is not JSON: {exc}", param_hint="--model-config"
        ) from exc
    try:
        g = KVGeometry.from_config(config, dtype=dtype)
        sizes = {
            "L1": parse_size(gpu_mem, "--gpu-mem"),
            "L2": parse_size(host_mem, "--host-mem"),
            "L3": parse_size(ssd, "--ssd"),
        }
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from exc
    if sessions <= 0 or avg_tokens <= 0 or chunk_tokens <= 0:
        raise click.UsageError("--sessions, --avg-tokens and --chunk-tokens must be positive")
    chunks = -(-avg_tokens // chunk_tokens)
    per_session = chunks * g.chunk_bytes(chunk_tokens)
    need = sessions * per_session
    click.echo(
        f"geometry: {g.num_layers} layers, {g.num_kv_heads} KV heads x {g.head_dim}, {g.dtype}, "
        f"{g.attention}; {g.bytes_per_token} bytes/token, {_fmt(g.chunk_bytes(chunk_tokens))} per "
        f"{chunk_tokens}-token chunk"
    )
    if g.sliding_layers:
        click.echo(
            f"sliding window {g.sliding_window} on {len(g.sliding_layers)} layers (sized as full here)"
        )
    click.echo(
        f"one session of {avg_tokens} tokens: {chunks} chunks, {_fmt(per_session)}; {sessions} sessions: {_fmt(need)}"
    )
    click.echo(f"{'tier':4} {'size':>12} {'sessions fit':>13}")
    left = sessions
    for tier, size in sizes.items():
        fit = size // per_session
        click.echo(f"{tier:4} {_fmt(size):>12} {fit:>13}")
        left -= min(left, fit)
    click.echo("configure (all sessions resident in L2 and L3, the busiest in L1):")
    click.echo(
        f"  l1_bytes = {min(sizes['L1'], need)}   l2_bytes = {min(sizes['L2'], need)}   l3_bytes = {min(sizes['L3'], need)}"
    )
    if sizes["L3"] + sizes["L2"] < need:
        click.echo(
            f"warning: L2+L3 hold {_fmt(sizes['L2'] + sizes['L3'])} < {_fmt(need)}: sessions beyond that are recomputed"
        )
