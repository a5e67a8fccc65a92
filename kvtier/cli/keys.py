"""`kvtier keys`: create, list and revoke the API keys `kvtier serve --api-keys` accepts."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import click

from kvtier import apikeys
from kvtier.errors import KeysFileError

file_option = click.option(
    "--file",
    "path",
    required=True,
    type=click.Path(dir_okay=False, path_type=Path),
    envvar="KVTIER_API_KEYS",
    help="The API keys file (env KVTIER_API_KEYS); the one `kvtier serve --api-keys` reads.",
)
RELOAD = "a running server reads the change on SIGHUP (kill -HUP <pid>)"


@contextmanager
def _failing_cleanly() -> Iterator[None]:
    try:
        yield
    except KeysFileError as exc:
        raise click.ClickException(str(exc)) from None


@click.group("keys", context_settings={"help_option_names": ["-h", "--help"]})
def command() -> None:
    """Create, list and revoke API keys (the server's tenants and admins).

    \b
    kvtier keys add TENANT [--admin] [--gateway] --file PATH
                                       print a new key (shown this once)
    kvtier keys list --file PATH       ids, tenants, admin and gateway flags; never keys
    kvtier keys revoke KEY_ID --file PATH   or --tenant TENANT: all of its keys
    The file holds only a SHA-256 of each key, mode 0600. A running server reloads it on SIGHUP.
    """


@command.command("add")
@click.argument("tenant")
@click.option("--admin", is_flag=True, help="The key may also run the admin endpoints.")
@click.option(
    "--gateway",
    is_flag=True,
    help="A gateway's key: with `kvtier serve --trust-tenant-header` its requests may name any "
    "tenant in X-Tenant (no other key may name another tenant). Give it only to a gateway that "
    "authenticates its clients itself.",
)
@file_option
def add(tenant: str, admin: bool, gateway: bool, path: Path) -> None:
    """Create a key for TENANT and print it; only its hash is stored, so it is shown once."""
    with _failing_cleanly():
        rec, key = apikeys.add(path, tenant, admin=admin, gateway=gateway)
    click.echo(key)
    what = " ".join([*(["admin"] if admin else []), *(["gateway"] if gateway else []), "key"])
    click.echo(
        f"kvtier keys: {what} {rec.id} for tenant {tenant!r} added to {path}; store the key "
        f"now, it is not shown again; {RELOAD}",
        err=True,
    )


@command.command("list")
@file_option
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")
def list_(path: Path, as_json: bool) -> None:
    """The keys in the file: id, tenant, admin and gateway flags, creation time (never the
    keys)."""
    with _failing_cleanly():
        ring = apikeys.load(path)
    rows: list[dict[str, Any]] = [
        {
            "id": r.id,
            "tenant": r.tenant,
            "admin": r.admin,
            "gateway": r.gateway,
            "created": r.created,
        }
        for r in ring.records
    ]
    if as_json:
        click.echo(json.dumps({"keys": rows}, indent=2))
        return
    if not rows:
        click.echo(f"no keys in {path}; add one with `kvtier keys add TENANT --file {path}`")
        return
    width = max(6, *(len(r["tenant"]) for r in rows))
    click.echo(f"{'ID':<8}  {'TENANT':<{width}}  {'ADMIN':<5}  {'GATEWAY':<7}  CREATED (UTC)")
    for r in rows:
        created = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(r["created"]))
        admin, gateway = ("yes" if r[flag] else "no" for flag in ("admin", "gateway"))
        click.echo(f"{r['id']:<8}  {r['tenant']:<{width}}  {admin:<5}  {gateway:<7}  {created}")


@command.command("revoke")
@click.argument("key_id", required=False)
@click.option("--tenant", help="Revoke every key of this tenant instead of one key.")
@file_option
def revoke(key_id: str | None, tenant: str | None, path: Path) -> None:
    """Remove the key KEY_ID (from `kvtier keys list`; the key itself works too), or with
    --tenant every key of a tenant."""
    if (key_id is None) == (tenant is None):
        raise click.UsageError("give a KEY_ID or --tenant TENANT (one of them)")
    if key_id is not None and key_id.startswith(apikeys.PREFIX):
        key_id = key_id[len(apikeys.PREFIX) : len(apikeys.PREFIX) + 8]
    with _failing_cleanly():
        gone = apikeys.revoke(path, key_id=key_id, tenant=tenant)
    if not gone:
        what = f"key {key_id}" if key_id is not None else f"key of tenant {tenant!r}"
        raise click.ClickException(f"no {what} in {path}; see `kvtier keys list --file {path}`")
    for r in gone:
        click.echo(f"revoked {r.id} (tenant {r.tenant!r}{', admin' if r.admin else ''})")
    click.echo(f"kvtier keys: {RELOAD}", err=True)
