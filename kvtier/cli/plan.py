"""`kvtier plan`: how many sessions fit in each tier, and the L1/L2/L3 sizes to configure."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import click

from kvtier.errors import ConfigError
from kvtier.geometry import KVGeometry
from kvtier.humanize import plural
from kvtier.humanize import size as _fmt
from kvtier.units import parse_size


def read_model_config(path: Path) -> dict[str, object]:
    """A model's config.json, given the file or the model directory that holds it."""
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise click.BadParameter(
            f"{path} holds no config.json; pass a model directory or its config.json",
            param_hint="--model-config",
        )
    try:
        config = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise click.BadParameter(f"{file} is not JSON: {exc}", param_hint="--model-config") from exc
    if not isinstance(config, dict):
        raise click.BadParameter(f"{file} is not a JSON object", param_hint="--model-config")
    return config


@click.command("plan", context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--model-config",
    type=click.Path(exists=True, path_type=Path),
    required=True,
    help="the model's config.json, or its model directory (samples: configs/models/)",
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
@click.option(
    "--gpu-memory-utilization",
    type=float,
    default=None,
    help="Also print the server's GPU memory plan, for a device of --gpu-mem at this fraction "
    "(weights and activations estimated from the config; the server measures them at start)",
)
@click.option(
    "--max-concurrency",
    type=int,
    default=64,
    show_default=True,
    help="with --gpu-memory-utilization: the batch's slots",
)
@click.option(
    "--batch-tokens",
    type=int,
    default=1024,
    show_default=True,
    help="with --gpu-memory-utilization: new tokens in one batched step",
)
@click.option(
    "--prefill-step",
    type=int,
    default=512,
    show_default=True,
    help="with --gpu-memory-utilization: prompt tokens per forward through the cache",
)
@click.option(
    "--max-model-len",
    "context_tokens",
    type=int,
    default=None,
    help="with --gpu-memory-utilization: a session's longest context (default: the config's "
    "max_position_embeddings)",
)
@click.option(
    "--trace",
    "trace_path",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="Size L2 and L3 from a request trace (Mooncake's JSONL: timestamp, input_length, "
    "output_length, hash_ids): simulate the tiers over it at a sweep of sizes and name those "
    "reaching 95%% of its ideal hit ratio. --gpu-mem is then one host's page pool (L1), "
    "--host-mem the L2 that L3 is swept behind; --sessions and --avg-tokens are not used",
)
@click.option(
    "--hosts", type=int, default=1, show_default=True, help="with --trace: hosts sharing the trace"
)
@click.option(
    "--sample",
    type=float,
    default=1.0,
    show_default=True,
    help="with --trace: the fraction of its conversations to simulate (whole, as kvtier replay "
    "--sample picks them)",
)
@click.option(
    "--l2-read-gbps", type=float, default=10.0, show_default=True, help="with --trace: L2 reads"
)
@click.option(
    "--l3-read-gbps",
    type=float,
    default=3.0,
    show_default=True,
    help="with --trace: L3 reads (the SSD's sequential read rate)",
)
@click.option(
    "--prefill-tflops",
    type=float,
    default=400.0,
    show_default=True,
    help="with --trace: the prefill's speed, for the cost model's restore-or-recompute choice "
    "(400: about half an H100's bf16 peak)",
)
@click.option(
    "--json",
    "json_out",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="with --trace: also write the sweep as JSON here",
)
def command(
    model_config: Path,
    sessions: int,
    avg_tokens: int,
    gpu_mem: str,
    host_mem: str,
    ssd: str,
    dtype: str | None,
    chunk_tokens: int,
    gpu_memory_utilization: float | None,
    max_concurrency: int,
    batch_tokens: int,
    prefill_step: int,
    context_tokens: int | None,
    trace_path: Path | None = None,
    hosts: int = 1,
    sample: float = 1.0,
    l2_read_gbps: float = 10.0,
    l3_read_gbps: float = 3.0,
    prefill_tflops: float = 400.0,
    json_out: Path | None = None,
) -> None:
    """Print bytes per token, sessions per tier and the sizes to configure.

    Only the model's architecture is read (layers, KV heads, head size, dtype): no weights.
    With --trace, the L2 and L3 sizes that a recorded workload needs instead.
    """
    config = read_model_config(model_config)
    try:
        g = KVGeometry.from_config(config, dtype=dtype)
        sizes = {
            "L1": parse_size(gpu_mem, "--gpu-mem"),
            "L2": parse_size(host_mem, "--host-mem"),
            "L3": parse_size(ssd, "--ssd"),
        }
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from exc
    if trace_path is not None:
        from kvtier.cli.plan_trace import TraceInputs, run

        if hosts < 1 or min(l2_read_gbps, l3_read_gbps, prefill_tflops) <= 0 or chunk_tokens <= 0:
            raise click.UsageError(
                "--hosts, --chunk-tokens, --l2-read-gbps, --l3-read-gbps and --prefill-tflops "
                "must be positive"
            )
        inputs = TraceInputs(
            trace_path, hosts, sample, sizes["L1"], sizes["L2"], chunk_tokens, l2_read_gbps,
            l3_read_gbps, prefill_tflops, json_out,
        )  # fmt: skip
        run(config, g, inputs)
        return
    if sessions <= 0 or avg_tokens <= 0 or chunk_tokens <= 0:
        raise click.UsageError("--sessions, --avg-tokens and --chunk-tokens must be positive")
    chunks = -(-avg_tokens // chunk_tokens)
    per_session = chunks * g.chunk_bytes(chunk_tokens)
    need = sessions * per_session
    click.echo(
        f"geometry: {plural(g.num_layers, 'layer')}, {plural(g.num_kv_heads, 'KV head')} x {g.head_dim}, {g.dtype}, "
        f"{g.attention}; {g.bytes_per_token} bytes/token, {_fmt(g.chunk_bytes(chunk_tokens))} per "
        f"{chunk_tokens}-token chunk"
    )
    if g.sliding_layers:
        click.echo(
            f"sliding window {g.sliding_window} on {plural(len(g.sliding_layers), 'layer')} "
            "(sized as full here)"
        )
    click.echo(
        f"one session of {plural(avg_tokens, 'token')}: {plural(chunks, 'chunk')}, "
        f"{_fmt(per_session)}; {plural(sessions, 'session')}: {_fmt(need)}"
    )
    click.echo(f"{'tier':4} {'size':>12} {'sessions fit':>13}")
    left = sessions
    for tier, size in sizes.items():
        fit = size // per_session
        click.echo(f"{tier:4} {_fmt(size):>12} {fit:>13}")
        left -= min(left, fit)
    click.echo(
        "configure (all sessions resident in L2 and L3; a TOML table for kvtier serve --config):"
    )
    for line in serve_table(sizes, need):
        click.echo(line)
    if sizes["L3"] + sizes["L2"] < need:
        click.echo(
            f"warning: L2+L3 hold {_fmt(sizes['L2'] + sizes['L3'])} < {_fmt(need)}: sessions beyond that are recomputed"
        )
    if gpu_memory_utilization is not None:
        shape = _Shape(max_concurrency, batch_tokens, prefill_step, chunk_tokens)
        _print_gpu_plan(config, g, sizes["L1"], gpu_memory_utilization, shape, context_tokens)


def serve_table(sizes: dict[str, int], need: int) -> list[str]:
    """The `[serve]` TOML table to configure: only keys `kvtier serve --config` reads.

    L1 is left to the server: with paged L1 (the default) the sessions' L1 is the batch's page
    pool, which `gpu_memory_utilization` sizes; `l1_bytes` is only the cache's copy staging."""
    l2, l3 = min(sizes["L2"], need), min(sizes["L3"], need)
    return [
        "[serve]",
        f"l2_bytes = {l2}  # {_fmt(l2)}",
        f"l3_max_bytes = {l3}  # {_fmt(l3)}",
        "# L1: leave l1_bytes out. With paged L1 (the default) the busiest sessions' L1 is the",
        "# page pool, sized by gpu_memory_utilization (--gpu-memory-utilization prints it);",
        f"# with paged_l1 = false, l1_bytes = {min(sizes['L1'], need)} holds them",
    ]


@dataclasses.dataclass(frozen=True)
class _Shape:
    max_concurrency: int
    batch_tokens: int
    prefill_step: int
    chunk_tokens: int


def _print_gpu_plan(
    config: dict[str, object],
    g: KVGeometry,
    total: int,
    utilization: float,
    shape: _Shape,
    context_tokens: int | None,
) -> None:
    """The server's GPU memory plan for a device of `total` bytes, from the config alone."""
    from kvtier.server.memplan import offline_plan

    if min(shape.max_concurrency, shape.batch_tokens, shape.prefill_step) <= 0:
        raise click.UsageError(
            "--max-concurrency, --batch-tokens and --prefill-step must be positive"
        )
    try:
        plan = offline_plan(
            config, g, total, utilization, shape.max_concurrency, shape.batch_tokens,
            shape.prefill_step, shape.chunk_tokens, context_tokens,
        )  # fmt: skip
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from exc
    context = context_tokens or int(str(config.get("max_position_embeddings") or 4096))
    per_session = g.bytes_per_token * context
    click.echo(f"GPU memory plan (--gpu-mem as the device, {utilization:.2f} of it):")
    click.echo(f"  {'part':12} {'bytes':>12}")
    for part, nbytes in plan.parts().items():
        click.echo(f"  {part:12} {_fmt(nbytes):>12}")
    click.echo(f"  {'budget':12} {_fmt(plan.budget_bytes):>12}")
    click.echo(
        f"the page pool holds {plural(plan.pool // max(1, g.bytes_per_token), 'token')}: "
        f"{plan.pool // max(1, per_session)} full-context sessions, "
        f"{plan.pool // max(1, g.bytes_per_token * 3000)} of 3,000 tokens"
    )
