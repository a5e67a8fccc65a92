"""`kvtier fleet haproxy-config`: the HAProxy configuration of a fleet of kvtier hosts.

Each session stays on one host: `balance hdr(X-Session-ID)` with `hash-type consistent`, so a
host that goes away gives its sessions to the others (their next turns restore from L4) and
every other session stays where it is. HAProxy asks each host's `/readyz`: a host loading,
warming up, draining (`POST /admin/drain`) or gone is taken out after `fall` checks and put
back after `rise`. A request HAProxy could not even send (the host refused the connection) is
sent to another host (`retry-on conn-failure`, `option redispatch`); one a host took and then
lost is not replayed: the client sees the failure and retries (docs/deploy.md).
"""

from __future__ import annotations

import re
from pathlib import Path

import click

from kvtier.errors import ConfigError

_HOST = re.compile(r"^(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9.-]+):(\d{1,5})$")


def parse_hosts(spec: str) -> list[tuple[str, int]]:
    """`host:port,host:port` -> [(host, port)]; ConfigError naming the bad entry."""
    out = []
    for part in (p.strip() for p in spec.split(",")):
        m = _HOST.match(part)
        if not m or not 0 < int(m.group(2)) < 65536:
            raise ConfigError(
                f"--hosts: {part!r} is not host:port; name each kvtier serve host, e.g. "
                "--hosts 10.0.0.1:8000,10.0.0.2:8000,10.0.0.3:8000"
            )
        out.append((m.group(1), int(m.group(2))))
    if len(set(out)) != len(out):
        raise ConfigError("--hosts names a host twice; each kvtier serve host once")
    return out


def haproxy_config(
    hosts: list[tuple[str, int]],
    bind: str = "*:8080",
    check_ms: int = 1000,
    fall: int = 2,
    rise: int = 2,
    timeout_s: int = 600,
    stats_bind: str | None = None,
) -> str:
    """The configuration text (see the module docstring)."""
    servers = "\n".join(
        f"    server kvtier{i} {h}:{p} check" for i, (h, p) in enumerate(hosts, start=1)
    )
    stats = (
        ""
        if stats_bind is None
        else f"\nfrontend kvtier_stats\n    bind {stats_bind}\n    http-request use-service "
        "prometheus-exporter if { path /metrics }\n    stats enable\n    stats uri /stats\n"
    )
    return f"""\
# kvtier fleet: HAProxy in front of {len(hosts)} kvtier serve hosts (kvtier fleet haproxy-config).
# Sessions stick to a host by a consistent hash of X-Session-ID; /readyz takes a host out while
# it loads, warms up or drains (POST /admin/drain), and puts it back when it answers 200 again.
global
    log stdout format raw local0 info
    maxconn 4096

defaults
    mode http
    log global
    option httplog
    timeout connect 2s
    timeout client {timeout_s}s
    timeout server {timeout_s}s
    timeout queue 30s
    # a request the host never received (connection refused) goes to the next host; one it
    # received is not replayed (the client retries: docs/deploy.md)
    retries 2
    retry-on conn-failure
    option redispatch 1

frontend kvtier
    bind {bind}
    default_backend kvtier_hosts

backend kvtier_hosts
    balance hdr(X-Session-ID)
    hash-type consistent
    option httpchk GET /readyz
    http-check expect status 200
    http-response set-header X-Kvtier-Host %s  # which host served: logs, clients, tests
    default-server inter {check_ms}ms fall {fall} rise {rise}
{servers}
{stats}"""


@click.group("fleet")
def command() -> None:
    """Run kvtier hosts as a fleet: the router's configuration (docs/deploy.md)."""


@command.command("haproxy-config")
@click.option("--hosts", required=True, help="kvtier serve hosts: host:port,host:port,...")
@click.option("--bind", default="*:8080", show_default=True, help="HAProxy's listen address.")
@click.option("--check-ms", default=1000, show_default=True, help="Health check period (ms).")
@click.option("--fall", default=2, show_default=True, help="Failed checks that take a host out.")
@click.option("--rise", default=2, show_default=True, help="Good checks that put it back.")
@click.option("--timeout-s", default=600, show_default=True, help="Longest request (seconds).")
@click.option("--stats-bind", help="Also serve HAProxy's stats and /metrics here, e.g. :8404.")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), help="Write here.")
def haproxy_config_command(
    hosts: str,
    bind: str,
    check_ms: int,
    fall: int,
    rise: int,
    timeout_s: int,
    stats_bind: str | None,
    out: Path | None,
) -> None:
    """Write HAProxy's configuration for kvtier hosts: consistent hash on X-Session-ID,
    health checks on /readyz."""
    try:
        parsed = parse_hosts(hosts)
        if min(check_ms, fall, rise, timeout_s) < 1:
            raise ConfigError("--check-ms, --fall, --rise and --timeout-s must be at least 1")
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from None
    text = haproxy_config(parsed, bind, check_ms, fall, rise, timeout_s, stats_bind)
    if out is None:
        click.echo(text, nl=False)
    else:
        out.write_text(text)
        click.echo(f"wrote {out} ({len(parsed)} hosts); check it with: haproxy -c -f {out}")
