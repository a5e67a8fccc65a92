"""`kvtier exporter`: the standalone Prometheus exporter (L3 index read-only + host signals)."""

from __future__ import annotations

import signal
import threading

import click

from kvtier.errors import KvtierError


@click.command("exporter", context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--l3-root",
    required=True,
    type=click.Path(file_okay=False, path_type=str),
    help="Root directory of the L3 store (opened read-only).",
)
@click.option(
    "--listen",
    default="127.0.0.1:9481",
    show_default=True,
    help="HOST:PORT to serve /metrics on. Loopback by default; widen it deliberately.",
)
@click.option("--host", default=None, help="Address to bind: the HOST of --listen.")
@click.option(
    "--port",
    type=click.IntRange(0, 65535),
    default=None,
    help="TCP port: the PORT of --listen (9481 unless given; 0 picks a free one).",
)
@click.option("--no-gpu", is_flag=True, help="Skip NVML queries (GPU metrics).")
def command(l3_root: str, listen: str, host: str | None, port: int | None, no_gpu: bool) -> None:
    """Standalone Prometheus exporter for a host whose cache runs elsewhere.

    Serves what the L3 store's index records (read-only): the L3 tier's occupancy and the
    session records, hibernated and pinned. Also the host's memory, fragmentation, page cache,
    disk and GPU signals. Restores, L1 and L2 live in the server: scrape it for those.
    Metrics and how the two differ: docs/metrics.md.
    """
    from ops.exporter.standalone import build_exporter, parse_listen, serve

    try:
        if host is not None or port is not None:  # --host / --port: parts of --listen
            listen_host, listen_port = parse_listen(listen)
            host = (host or listen_host).strip("[]")
            port = listen_port if port is None else port
            listen = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        registry, watch = build_exporter(l3_root, nvml=not no_gpu)
        server = serve(registry, listen)
    except KvtierError as exc:
        raise click.UsageError(str(exc)) from None
    except OSError as exc:
        raise click.UsageError(
            f"cannot listen on {listen}: {exc.strerror}; pick a free port"
        ) from None
    bound_host, bound_port = server.server_address[:2]
    click.echo(
        f"kvtier exporter: http://{bound_host}:{bound_port}/metrics  l3_root={l3_root}", err=True
    )
    if not watch.up():
        click.echo(
            f"kvtier exporter: no L3 store in {l3_root} yet ({watch.why_down}); exporting "
            "kvtier_l3_up 0 until the cache creates it",
            err=True,
        )
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    server.shutdown()
    watch.close()
