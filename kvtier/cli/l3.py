"""`kvtier l3 ...`: inspect, check and maintain the SSD tier (ls, stat, fsck, migrate, gc)."""

from __future__ import annotations

import json
import re
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict
from typing import Any

import click

from kvtier.cli.options import aliased_option
from kvtier.errors import EncryptionError, StoreError
from kvtier.humanize import plural
from kvtier.humanize import size as _human
from kvtier.tiers.l3 import L3Store
from kvtier.tiers.l3.maint import Progress
from kvtier.units import size_arg

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_duration(text: str) -> float:
    """'90s', '30m', '12h', '7d', '2w' -> seconds."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*", text.lower())
    if not m:
        raise click.BadParameter(f"{text!r} is not a duration; write e.g. 30m, 12h, 7d or 2w")
    return float(m.group(1)) * _UNITS[m.group(2) or "s"]


def parse_size(text: str) -> int:
    """A size for an l3 command: `kvtier.units.parse_size`, the one meaning every command uses
    (K/M/G/T decimal, Ki/Mi/Gi/Ti binary); a bad size is a usage error."""
    return size_arg(text, "size")


root_option = aliased_option(
    "--l3-root",
    "--root",
    "root",
    required=True,
    type=click.Path(file_okay=False, path_type=str),
    envvar="KVTIER_L3_ROOT",
    help="L3 store directory (env KVTIER_L3_ROOT).",
)
json_option = click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")


def cold_options(f: Any) -> Any:
    """--l3-cold-root and --adopt-cold-root, for the commands that open the store writable."""
    f = click.option(
        "--adopt-cold-root",
        is_flag=True,
        help="Record --l3-cold-root as the store's cold root although another one is recorded "
        "(after moving the cold files there).",
    )(f)
    return aliased_option(
        "--l3-cold-root",
        "--cold-dir",
        "cold_dir",
        type=click.Path(file_okay=False),
        default=None,
        envvar="KVTIER_L3_COLD_ROOT",
        help="Cold tier directory (env KVTIER_L3_COLD_ROOT). Recorded in the store the first "
        "time; left out, the recorded one (default <l3-root>/cold) is used.",
    )(f)


# fsck's exit status, as fsck(8) where the meanings match; a bad option exits 2, as every
# command's (click's usage error), so "problems left" is fsck(8)'s 4, not the report's 2.
FSCK_PROBLEMS_LEFT = 4  # as fsck(8): errors left uncorrected
FSCK_OPERATIONAL_ERROR = 8  # as fsck(8): the check could not run (store in use, bad root)
FSCK_STATUS = {0: 0, 1: 1, 2: FSCK_PROBLEMS_LEFT}  # FsckReport.exit_code -> exit status


def _open(
    root: str,
    *,
    read_only: bool,
    cold_dir: str | None = None,
    adopt: bool = False,
    exit_code: int = 1,
    master_key_file: str | None = None,
) -> L3Store:
    with _failing_cleanly(exit_code):
        key = None
        if master_key_file is not None:
            from kvtier.sealing import load_master_key

            key = load_master_key(master_key_file)  # not 0600, malformed, wrong: said, exit
        return L3Store(
            root,
            read_only=read_only,
            cold_dir=cold_dir,
            adopt_cold_root=adopt,
            master_key=key,
            need_key=key is not None,
        )


@contextmanager
def _failing_cleanly(exit_code: int = 1) -> Iterator[None]:
    """A store error: its one-line message on stderr and `exit_code`, no traceback."""
    try:
        yield
    except (StoreError, EncryptionError) as exc:
        error = click.ClickException(" ".join(str(exc).split()))
        setattr(error, "exit_code", exit_code)  # noqa: B010 (a ClassVar in the stubs)
        raise error from None


@contextmanager
def _progress(label: str, enabled: bool) -> Iterator[Progress | None]:
    """A rich progress bar on stderr when it is a terminal and JSON is not requested."""
    if not enabled or not sys.stderr.isatty():
        yield None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeRemainingColumn

    with Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        MofNCompleteColumn(),
        TimeRemainingColumn(),
        console=Console(stderr=True),
        transient=True,
    ) as bar:
        task = bar.add_task(label, total=None)

        def update(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        yield update


def _emit(data: Any, as_json: bool, text: str) -> None:
    click.echo(json.dumps(data, indent=2, sort_keys=True) if as_json else text)


@click.group("l3", context_settings={"help_option_names": ["-h", "--help"]})
def command() -> None:
    """Inspect, check and maintain the SSD tier (.kvbin files + SQLite index)."""


@command.command("ls")
@root_option
@json_option
@click.option("--limit", type=int, default=None, help="Show at most this many chunks.")
def ls_command(root: str, as_json: bool, limit: int | None) -> None:
    """List chunks, least recently used first, with the tenant each belongs to (tenants are
    only shown, never used as paths)."""
    with _open(root, read_only=True) as store:
        rows = list(store.index.iter_chunks(order_lru=True))[:limit]
    if as_json:
        _emit(
            [
                {
                    "key": r.header.key.hex(),
                    "tier": r.tier,
                    "bytes": r.size,
                    "tokens": r.header.tokens,
                    "tenant": r.header.tenant,
                    "fingerprint": r.header.fingerprint.hex(),
                    "codec": r.header.codec,
                    "created": r.header.created,
                    "last_access": r.last_access,
                }
                for r in rows
            ],
            True,
            "",
        )
        return
    width = max([6, *(len(_shown(r.header.tenant)) for r in rows)])
    click.echo(
        f"{'key':32}  {'tier':4}  {'size':>10}  {'tokens':>6}  {'codec':6}  "
        f"{'tenant':{width}}  last used"
    )
    for r in rows:
        used = time.strftime("%Y-%m-%d %H:%M", time.localtime(r.last_access))
        click.echo(
            f"{r.header.key.hex()}  {r.tier:4}  {_human(r.size):>10}  {r.header.tokens:>6}  "
            f"{r.header.codec:6}  {_shown(r.header.tenant):{width}}  {used}"
        )


def _shown(tenant: str) -> str:
    """A tenant for a text column: control characters escaped, at most 40 characters."""
    text = tenant.encode("unicode_escape").decode("ascii") if not tenant.isprintable() else tenant
    return text if len(text) <= 40 else text[:39] + "…"


@command.command("stat")
@root_option
@json_option
def stat_command(root: str, as_json: bool) -> None:
    """Occupancy of the store: chunks and bytes per tier (hot, cold), the chunks no session
    references (what `kvtier l3 gc` may delete), sessions, capacity."""
    with _open(root, read_only=True) as store:
        stats = store.stats()
        tiers: dict[str, dict[str, int]] = {}
        for r in store.index.iter_chunks():
            t = tiers.setdefault(r.tier, {"chunks": 0, "bytes": 0})
            t["chunks"] += 1
            t["bytes"] += r.size
        unreferenced = {"chunks": 0, "bytes": 0}
        for r in store.index.unreferenced_lru(batch=1024):
            unreferenced["chunks"] += 1
            unreferenced["bytes"] += r.size
    data = {
        "root": root,
        "chunks": stats.chunks,
        "used_bytes": stats.used_bytes,
        "capacity_bytes": stats.capacity_bytes,
        "sessions": stats.sessions,
        "cold_root": str(store.dir("cold")),
        "tiers": tiers,
        "unreferenced": unreferenced,
        "master_key_id": store.master_key_id,  # None: not encrypted
    }
    sealed = f"AES-256-GCM, master key id {store.master_key_id}" if store.master_key_id else "off"
    lines = [
        f"root       {root}",
        f"chunks     {stats.chunks}",
        f"used       {_human(stats.used_bytes)} of {_human(stats.capacity_bytes)}",
        f"sessions   {stats.sessions}",
        f"cold root  {store.dir('cold')}",
        f"encryption {sealed}",
    ]
    lines += [
        f"{name:10} {plural(t['chunks'], 'chunk')}, {_human(t['bytes'])}"
        for name, t in sorted(tiers.items())
    ]
    lines.append(
        f"unreferenced {plural(unreferenced['chunks'], 'chunk')}, "
        f"{_human(unreferenced['bytes'])} (no session uses them; `kvtier l3 gc` deletes them)"
    )
    _emit(data, as_json, "\n".join(lines))


@command.command("fsck")
@root_option
@json_option
@click.option("--rebuild", is_flag=True, help="Rebuild the chunk index from file headers alone.")
@click.option("--check", "check_only", is_flag=True, help="Report problems; repair nothing.")
@click.option(
    "--master-key-file",
    type=click.Path(dir_okay=False),
    envvar="KVTIER_MASTER_KEY_FILE",
    help="An encrypted store's master key (env KVTIER_MASTER_KEY_FILE): without it the sealed "
    "session records that reference a damaged chunk are reported (LEFT), not cut.",
)
@cold_options
def fsck_command(
    root: str,
    as_json: bool,
    rebuild: bool,
    check_only: bool,
    master_key_file: str | None,
    cold_dir: str | None,
    adopt_cold_root: bool,
) -> None:
    """Verify every chunk (header, checksums, size) and reconcile the index with the files.

    Damaged chunks are quarantined; a hibernated session that referenced one keeps the prefix
    before it (the rest is recomputed on restore). Needs the store to itself unless --check.

    \b
    Exit status (like fsck(8), where 1 means "errors corrected"):
      0  clean: nothing to repair
      1  problems found and all repaired; the next run exits 0
      2  usage error (a bad option), as every kvtier command
      4  problems left: found with --check, or not repairable; see LEFT
      8  operational error: the check could not run (store in use, unsafe root)
    """
    from kvtier.tiers.l3.maint import fsck

    with (
        _open(
            root,
            read_only=check_only,
            cold_dir=cold_dir,
            adopt=adopt_cold_root,
            exit_code=FSCK_OPERATIONAL_ERROR,
            master_key_file=master_key_file,
        ) as store,
        _progress("fsck", not as_json) as progress,
        _failing_cleanly(FSCK_OPERATIONAL_ERROR),
    ):
        report = fsck(store, rebuild=rebuild, repair=not check_only, progress=progress)
    status = FSCK_STATUS[report.exit_code]
    data = {**asdict(report), "repaired": report.repaired, "exit_code": status}
    lines = [
        f"files checked   {report.files} ({report.ok} ok)",
        f"quarantined     {len(report.quarantined)}",
        f"index repaired  {report.indexed} added, {report.stale_rows} stale rows removed"
        + (" (index rebuilt from headers)" if rebuild else ""),
        f"temp removed    {report.temp_removed}",
        f"sessions cut    {len(report.sessions_truncated)}",
    ]
    lines += [f"  quarantined: {q}" for q in report.quarantined]
    lines += [f"  session cut: {q}" for q in report.sessions_truncated]
    lines += [f"  LEFT: {p}" for p in report.left]
    lines.append(["clean", "problems found and repaired", "problems left"][report.exit_code])
    _emit(data, as_json, "\n".join(lines))
    sys.exit(status)


@command.command("migrate")
@root_option
@json_option
@click.option("--older-than", default="7d", show_default=True, help="Idle time, e.g. 12h, 7d.")
@cold_options
def migrate_command(
    root: str, as_json: bool, older_than: str, cold_dir: str | None, adopt_cold_root: bool
) -> None:
    """Move chunks idle longer than --older-than from hot to cold (copy, fsync, then unlink).

    The cold root is recorded in the store, so the cache and later commands find the chunks
    there without being told."""
    from kvtier.tiers.l3.maint import migrate

    seconds = parse_duration(older_than)
    with (
        _open(root, read_only=False, cold_dir=cold_dir, adopt=adopt_cold_root) as store,
        _progress("migrate", not as_json) as progress,
        _failing_cleanly(),
    ):
        report = migrate(store, seconds, progress=progress)
    _emit(
        asdict(report),
        as_json,
        f"moved {plural(report.chunks, 'chunk')} ({_human(report.bytes)}) to cold",
    )


@command.command("gc")
@root_option
@json_option
@click.option(
    "--older-than",
    default="30d",
    show_default=True,
    help="Delete unreferenced chunks idle this long.",
)
@click.option(
    "--max-bytes", default=None, help="Then evict unreferenced LRU chunks to this size (e.g. 500G)."
)
@cold_options
def gc_command(
    root: str,
    as_json: bool,
    older_than: str,
    max_bytes: str | None,
    cold_dir: str | None,
    adopt_cold_root: bool,
) -> None:
    """Delete chunks no session references: idle past --older-than, then LRU down to --max-bytes.
    Expired unpinned sessions (past their TTL) are dropped first."""
    from kvtier.tiers.l3.maint import gc

    seconds = parse_duration(older_than)
    cap = size_arg(max_bytes, "--max-bytes") if max_bytes else None
    with (
        _open(root, read_only=False, cold_dir=cold_dir, adopt=adopt_cold_root) as store,
        _progress("gc", not as_json) as progress,
        _failing_cleanly(),
    ):
        report = gc(store, older_than_s=seconds, max_bytes=cap, progress=progress)
    _emit(
        asdict(report),
        as_json,
        f"deleted {plural(report.chunks, 'chunk')} ({_human(report.bytes)}); "
        f"{plural(report.sessions_expired, 'expired session')} dropped",
    )


@command.command("shred")
@root_option
@json_option
@click.option("--tenant", required=True, help="The tenant whose data is destroyed.")
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
def shred_command(root: str, as_json: bool, tenant: str, yes: bool) -> None:
    """Crypto-shred TENANT: destroy its data key and session records, so every chunk and
    record of it is unreadable at once (the files go with the next `kvtier l3 gc`). Needs no
    master key. In a store without encryption its chunk files and records are deleted now.
    A running server holds the store: use its DELETE /v1/tenants/TENANT instead."""
    if not yes:
        click.confirm(f"destroy every chunk and session of tenant {tenant!r} for good?", abort=True)
    with _open(root, read_only=False) as store, _failing_cleanly():
        report = store.shred_tenant(tenant)
    how = (
        f"data key destroyed: {plural(report.chunks, 'chunk')} unreadable, removed by the next gc"
        if report.encrypted
        else f"store is not encrypted: {plural(report.chunks, 'chunk')} deleted"
    )
    _emit(
        asdict(report),
        as_json,
        f"tenant {_shown(tenant)} shredded; {how}; {plural(report.sessions, 'session')} deleted",
    )
