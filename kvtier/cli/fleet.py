"""`kvtier fleet haproxy-config`: the HAProxy configuration of a fleet of kvtier hosts, rendered
from the template the Ansible role uses too (kvtier/haproxy.py says what it does)."""

from __future__ import annotations

import re
from pathlib import Path

import click

from kvtier import haproxy
from kvtier.errors import ConfigError

_D = haproxy.DEFAULTS
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


def haproxy_config(hosts: list[tuple[str, int]], **options: object) -> str:
    """The configuration text (kvtier/haproxy.cfg.j2) for `hosts`; `options` as in
    kvtier.haproxy.DEFAULTS."""
    return haproxy.render([f"{h}:{p}" for h, p in hosts], **options)


@click.group("fleet")
def command() -> None:
    """Run kvtier hosts as a fleet: the router's configuration (docs/deploy.md)."""


@command.command("haproxy-config")
@click.option("--hosts", required=True, help="kvtier serve hosts: host:port,host:port,...")
@click.option("--bind", default=_D["bind"], show_default=True, help="HAProxy's listen address.")
@click.option("--check-ms", default=_D["check_ms"], show_default=True, help="Check period (ms).")
@click.option("--fall", default=_D["fall"], show_default=True, help="Failed checks: host out.")
@click.option("--rise", default=_D["rise"], show_default=True, help="Good checks: host back.")
@click.option(
    "--timeout-s", default=_D["timeout_s"], show_default=True, help="Longest request (s)."
)
@click.option(
    "--stats-bind", default="", help="Also serve HAProxy's stats and /metrics here, e.g. :8404."
)
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), help="Write here.")
def haproxy_config_command(
    hosts: str,
    bind: str,
    check_ms: int,
    fall: int,
    rise: int,
    timeout_s: int,
    stats_bind: str,
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
    text = haproxy_config(
        parsed,
        bind=bind,
        check_ms=check_ms,
        fall=fall,
        rise=rise,
        timeout_s=timeout_s,
        stats_bind=stats_bind,
    )
    if out is None:
        click.echo(text, nl=False)
    else:
        out.write_text(text)
        click.echo(f"wrote {out} ({len(parsed)} hosts); check it with: haproxy -c -f {out}")
