"""`kvtier doctor`: check this host against the recommended tuning (ops.tuning, ops.doctor)."""

from __future__ import annotations

import json
import os

import click

from kvtier.cli.options import aliased_option
from kvtier.units import size_option
from ops import doctor, tuning

_MARK = {"ok": "ok", "info": "info", "warning": "WARN", "critical": "CRIT"}


def _default_l3_root() -> str:
    """KVTIER_L3_ROOT, else the role's L3 root when it exists, else the server's default."""
    env = os.environ.get("KVTIER_L3_ROOT")
    if env:
        return env
    if os.path.isdir(tuning.L3_ROOT):
        return tuning.L3_ROOT
    import platformdirs

    return os.path.join(platformdirs.user_data_dir("kvtier", appauthor=False), "l3")


@click.command("doctor")
@click.option("--json", "as_json", is_flag=True, help="Print {'findings': [...]} as JSON.")
@click.option(
    "--l3-root",
    type=click.Path(file_okay=False),
    default=None,
    help="The L3 directory to check [default: KVTIER_L3_ROOT, else /var/lib/kvtier/l3 when it "
    "exists, else the server's default].",
)
@aliased_option(
    "--l2-bytes",
    "--l2-size",
    "l2_size",
    envvar="KVTIER_L2_BYTES",
    callback=size_option,
    default=None,
    help="The configured L2 size (e.g. 64GiB) for the memlock and huge page checks "
    "[env KVTIER_L2_BYTES].",
)
@click.option("--l3-owner", default=None, help="The user that should own the L3 root "
              f"[default: {tuning.SERVICE} when it exists, else you].")  # fmt: skip
@click.option(
    "--l4-url",
    envvar="KVTIER_L4_URL",
    default=None,
    help="The shared L4 tier's Redis (redis://host:port/db): check that it answers and its "
    "maxmemory and maxmemory-policy [env KVTIER_L4_URL].",
)
def command(
    as_json: bool,
    l3_root: str | None,
    l2_size: int | None,
    l3_owner: str | None,
    l4_url: str | None,
) -> None:
    """Check this host against the recommended tuning (the values the Ansible role applies).

    Exit code: 0 healthy, 1 warnings, 2 critical. Each finding names its fix: a variable of
    the kvtier_host role or a command.
    """
    facts = doctor.collect(l3_root=l3_root or _default_l3_root(), l2_bytes=l2_size, owner=l3_owner)
    findings = doctor.check(facts)
    if l4_url:
        from ops import doctor_l4

        findings += doctor_l4.check_l4(doctor_l4.collect_l4(l4_url))
    if as_json:
        click.echo(json.dumps({"findings": [f.as_dict() for f in findings]}, indent=2))
    else:
        for f in findings:
            click.echo(f"{_MARK[f.severity]:<5} {f.id:<32} {f.observed}")
            if f.severity in ("warning", "critical"):
                click.echo(f"      recommended: {f.recommended}")
                click.echo(f"      why: {f.why}")
                click.echo(f"      fix: {f.fix}")
        code = doctor.exit_code(findings)
        click.echo(["healthy", "warnings found", "critical findings"][code])
    raise SystemExit(doctor.exit_code(findings))
