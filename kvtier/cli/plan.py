"""`kvtier plan`: how many sessions fit in each tier, and the L1/L2/L3 sizes to configure."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING

import click

from kvtier.cli.options import aliased_option
from kvtier.errors import ConfigError
from kvtier.geometry import KVGeometry
from kvtier.humanize import plural
from kvtier.humanize import size as _fmt
from kvtier.units import size_option

if TYPE_CHECKING:  # pragma: no cover
    from kvtier.server.devices.memplan import DeviceMemoryPlan


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
@aliased_option(
    "--model",
    "--model-config",
    "model_config",
    type=click.Path(exists=True, path_type=Path),
    required=True,
    help="The model: its directory (as serve's --model) or its config.json; only the "
    "architecture is read (samples: configs/models/).",
)
@click.option(
    "--sessions", type=int, default=100, show_default=True, help="Sessions to keep alive."
)
@click.option(
    "--avg-tokens", type=int, default=3000, show_default=True, help="Average tokens per session."
)
@click.option(
    "--gpu-mem",
    default="24GiB",
    show_default=True,
    callback=size_option,
    help="The GPU's memory, all of it (the device, as nvidia-smi shows it); L1 is the page "
    "pool that the memory plan leaves of it after the weights and the rest.",
)
@aliased_option(
    "--l2-bytes",
    "--host-mem",
    "host_mem",
    default="64GiB",
    show_default=True,
    callback=size_option,
    help="Pinned host RAM for L2 (serve's --l2-bytes).",
)
@aliased_option(
    "--l3-max-bytes",
    "--ssd",
    "ssd",
    default="1TiB",
    show_default=True,
    callback=size_option,
    help="SSD space for L3 (serve's --l3-max-bytes).",
)
@click.option("--dtype", default=None, help="KV dtype (default: the config's).")
@click.option("--chunk-tokens", type=int, default=256, show_default=True, help="Tokens per chunk.")
@click.option(
    "--gpu-memory-utilization",
    type=float,
    default=0.9,
    show_default=True,
    help="The server's one GPU memory budget, as a fraction of --gpu-mem (serve's flag): "
    "weights and activations are estimated from the config (the server measures them at "
    "start); the page pool gets what is left.",
)
@click.option(
    "--max-concurrency",
    type=int,
    default=64,
    show_default=True,
    help="The batch's slots (serve's flag).",
)
@click.option(
    "--batch-tokens",
    type=int,
    default=1024,
    show_default=True,
    help="New tokens in one batched step (serve's flag).",
)
@click.option(
    "--prefill-step",
    type=int,
    default=512,
    show_default=True,
    help="Prompt tokens per forward through the cache (serve's flag).",
)
@click.option(
    "--max-model-len",
    "context_tokens",
    type=int,
    default=None,
    help="A session's longest context, as serve's flag: one such session must fit the page "
    "pool (default: the config's max_position_embeddings).",
)
@click.option(
    "--trace",
    "trace_path",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="Size L2 and L3 from a request trace (Mooncake's JSONL: timestamp, input_length, "
    "output_length, hash_ids): simulate the tiers over it at a sweep of sizes and name those "
    "reaching 95%% of its ideal hit ratio. L1 is one host's page pool, as the GPU memory plan "
    "leaves it of --gpu-mem; --l2-bytes is the L2 that L3 is swept behind; --sessions and "
    "--avg-tokens are not used",
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
    gpu_mem: int,
    host_mem: int,
    ssd: int,
    dtype: str | None,
    chunk_tokens: int,
    gpu_memory_utilization: float,
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
    """Print bytes per token, sessions per tier, the GPU memory plan and the sizes to configure.

    Only the model's architecture is read (layers, KV heads, head size, dtype): no weights.
    The words are serve's: L1 is the batch's page pool, which the GPU memory plan leaves of
    --gpu-mem (the whole device) at --gpu-memory-utilization after the weights, activations,
    CUDA graphs and copy buffers; L2 is --l2-bytes, L3 --l3-max-bytes. A plan serve would
    refuse (one --max-model-len session does not fit the pool) exits 1 saying what fits.
    With --trace, the L2 and L3 sizes that a recorded workload needs instead.
    """
    config = read_model_config(model_config)
    try:
        g = KVGeometry.from_config(config, dtype=dtype)
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from exc
    if sessions <= 0 or avg_tokens <= 0 or chunk_tokens <= 0:
        raise click.UsageError("--sessions, --avg-tokens and --chunk-tokens must be positive")
    shape = _Shape(max_concurrency, batch_tokens, prefill_step, chunk_tokens)
    plan, refused = _gpu_plan(config, g, gpu_mem, gpu_memory_utilization, shape, context_tokens)
    if trace_path is not None:
        from kvtier.cli.plan_trace import TraceInputs, run

        if plan is None:
            raise click.ClickException(f"L1: {refused}")

        if hosts < 1 or min(l2_read_gbps, l3_read_gbps, prefill_tflops) <= 0 or chunk_tokens <= 0:
            raise click.UsageError(
                "--hosts, --chunk-tokens, --l2-read-gbps, --l3-read-gbps and --prefill-tflops "
                "must be positive"
            )
        inputs = TraceInputs(
            trace_path, hosts, sample, plan.pool, host_mem, chunk_tokens, l2_read_gbps,
            l3_read_gbps, prefill_tflops, json_out,
        )  # fmt: skip
        run(config, g, inputs)
        return
    # L1 is the page pool (paged L1, the default): what the GPU plan leaves after the weights
    sizes = {"L1": plan.pool if plan else 0, "L2": host_mem, "L3": ssd}
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
    for tier, size in sizes.items():
        shown = _fmt(size) if tier != "L1" or plan else "-"
        click.echo(f"{tier:4} {shown:>12} {size // per_session:>13}")
    if plan is not None:
        _print_gpu_plan(config, g, plan, gpu_mem, gpu_memory_utilization, context_tokens)
    click.echo(
        "configure (all sessions resident in L2 and L3; a TOML table for kvtier serve --config):"
    )
    for line in serve_table(sizes, need):
        click.echo(line)
    if sizes["L3"] + sizes["L2"] < need:
        click.echo(
            f"warning: L2+L3 hold {_fmt(sizes['L2'] + sizes['L3'])} < {_fmt(need)}: sessions beyond that are recomputed"
        )
    if refused is not None:
        raise click.ClickException(f"L1: {refused}")


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
        "# page pool, sized by gpu_memory_utilization (the GPU memory plan above)",
    ]


# The plan's parts as kvtop and loadgen name them: L1 is the page pool (the sessions' KV on the
# GPU), the cache's own GPU buffers (l1_bytes; copy staging with paged L1) are "L1 buffers"
_PART_NAMES = {"pool": "pool (L1)", "l1": "L1 buffers"}


@dataclasses.dataclass(frozen=True)
class _Shape:
    max_concurrency: int
    batch_tokens: int
    prefill_step: int
    chunk_tokens: int


def _gpu_plan(
    config: dict[str, object],
    g: KVGeometry,
    total: int,
    utilization: float,
    shape: _Shape,
    context_tokens: int | None,
) -> tuple[DeviceMemoryPlan | None, str | None]:
    """The server's GPU memory plan for a device of `total` bytes, from the config alone; or
    None and the reason `kvtier serve` would refuse it."""
    from kvtier.server.devices.memplan import offline_plan

    if min(shape.max_concurrency, shape.batch_tokens, shape.prefill_step) <= 0:
        raise click.UsageError(
            "--max-concurrency, --batch-tokens and --prefill-step must be positive"
        )
    if not 0 < utilization <= 1:
        raise click.BadParameter(
            f"{utilization} is not a fraction; give one in (0, 1], e.g. 0.9",
            param_hint="'--gpu-memory-utilization'",
        )
    try:
        return offline_plan(
            config, g, total, utilization, shape.max_concurrency, shape.batch_tokens,
            shape.prefill_step, shape.chunk_tokens, context_tokens,
        ), None  # fmt: skip
    except ConfigError as exc:
        return None, str(exc)


def _print_gpu_plan(
    config: dict[str, object],
    g: KVGeometry,
    plan: DeviceMemoryPlan,
    total: int,
    utilization: float,
    context_tokens: int | None,
) -> None:
    context = context_tokens or int(str(config.get("max_position_embeddings") or 4096))
    per_session = g.bytes_per_token * context
    click.echo(
        f"GPU memory plan (--gpu-mem {_fmt(total)} at --gpu-memory-utilization "
        f"{utilization:.2f}; L1 is its page pool):"
    )
    click.echo(f"  {'part':12} {'bytes':>12}")
    for part, nbytes in plan.parts().items():
        click.echo(f"  {_PART_NAMES.get(part, part):12} {_fmt(nbytes):>12}")
    click.echo(f"  {'budget':12} {_fmt(plan.budget_bytes):>12}")
    click.echo(
        f"the page pool holds {plural(plan.pool // max(1, g.bytes_per_token), 'token')}: "
        f"{plural(plan.pool // max(1, per_session), 'full-context session')} of {context:,}"
    )
