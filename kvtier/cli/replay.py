"""`kvtier replay TRACE`: a request trace against a running server, with loadgen's report."""

from __future__ import annotations

import json
from pathlib import Path

import click


@click.command("replay", context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("trace_file", metavar="TRACE", type=click.Path(exists=True, dir_okay=False))
@click.option("--url", default="http://127.0.0.1:8000", show_default=True, help="The server.")
@click.option(
    "--speed",
    type=float,
    default=1.0,
    show_default=True,
    help="Time scaling: 2 sends the turns twice as fast as the trace has them.",
)
@click.option(
    "--sample",
    type=float,
    default=1.0,
    show_default=True,
    help="Replay this fraction of the trace's conversations, each whole (every turn of it); "
    "which ones depends on --seed alone, the same on every run.",
)
@click.option(
    "--seed",
    type=int,
    default=0,
    show_default=True,
    help="Picks the --sample and the token ids each block becomes.",
)
@click.option(
    "--max-input",
    type=int,
    help="Cut prompts to their first N tokens (the server's context, less one reply token, "
    "cuts them anyway); the report counts the prompts cut and the tokens left out.",
)
@click.option("--max-output", type=int, help="Cut replies to N tokens (default: the trace's).")
@click.option(
    "--duration",
    type=float,
    help="Replay only the turns due in the first SECONDS (after --speed).",
)
@click.option(
    "--ignore-eos/--stop-at-eos",
    default=True,
    show_default=True,
    help="Run every reply to the trace's length (the server's ignore_eos), or let the "
    "end-of-sequence token end it.",
)
@click.option("--model", default="default", show_default=True, help="The served model's name.")
@click.option(
    "--tenant",
    help="The tenant every conversation runs under (X-Tenant). Default: replay-RUNID, fresh "
    "each run, so that a run finds nothing that an earlier one cached.",
)
@click.option(
    "--api-key",
    envvar="KVTIER_API_KEY",
    help="Send `Authorization: Bearer KEY` (a server with --api-keys; also KVTIER_API_KEY). The "
    "key names the tenant: a second run with the same --seed then finds the first one's blocks.",
)
@click.option(
    "--prefetch-ahead",
    type=float,
    default=0.0,
    show_default=True,
    metavar="SECONDS",
    help="Ask the server to read a returning turn's session into L2 (POST "
    "/v1/sessions/{id}/prefetch) this many seconds before the turn is due, so that its L3 reads "
    "overlap the wait; 0: off. The route is an admin's: a server without --api-keys answers it "
    "on loopback, else --api-key must be an admin key. The report counts the prefetches and "
    "where the turns after them restored from.",
)
@click.option(
    "--timeout", type=float, default=600.0, show_default=True, help="Seconds a turn may take."
)
@click.option(
    "--out",
    type=click.Path(dir_okay=False, path_type=Path),
    default="replay.json",
    show_default=True,
    help="JSON result (loadgen's, with a `replay` section).",
)
@click.option(
    "--png",
    type=click.Path(dir_okay=False, path_type=Path),
    default="replay.png",
    show_default=True,
    help="Plot of TTFT and of the hit ratio over the replay.",
)
def command(trace_file: str, out: Path, png: Path, **opts: object) -> None:
    """Replay TRACE, a request trace in Mooncake's JSONL format (timestamp ms, input_length,
    output_length, hash_ids of 512-token blocks), against a kvtier server.

    Each block becomes 512 fixed token ids of the server's vocabulary; a turn that extends an
    earlier one's blocks past the first continues its session (X-Session-ID). Reports the
    slice's ideal hit ratio and the one achieved (usage's cached tokens), TTFT, TPOT and
    end-to-end P50/P99, tokens/s, the restore mix and failed turns; writes JSON and a PNG.
    Exits 1 when a turn failed.
    """
    from kvtier.replay import ReplayConfig, run
    from kvtier.replay_report import format_replay, plot_replay
    from kvtier.trace import TraceError

    for name in ("max_input", "max_output"):
        v = opts[name]
        if v is not None and int(str(v)) < 1:
            raise click.BadParameter("must be at least 1", param_hint=f"--{name.replace('_', '-')}")
    if not 0 < float(str(opts["sample"])) <= 1:
        raise click.BadParameter("must be a fraction in (0, 1]", param_hint="--sample")
    if float(str(opts["prefetch_ahead"])) < 0:
        raise click.BadParameter("must not be negative (0: off)", param_hint="--prefetch-ahead")
    if not float(str(opts["speed"])) > 0:
        raise click.BadParameter("must be positive", param_hint="--speed")
    config = ReplayConfig(trace=trace_file, **opts)  # type: ignore[arg-type]
    try:
        result = run(config)
    except TraceError as exc:
        raise click.UsageError(str(exc)) from exc
    except RuntimeError as exc:
        raise click.ClickException(str(exc)) from exc
    out.write_text(json.dumps(result, indent=1))
    plot_replay(result, png)
    click.echo(format_replay(result))
    click.echo(f"\nresult: {out}  plot: {png}")
    if result["replay"]["failed_turns"]:
        raise SystemExit(1)
