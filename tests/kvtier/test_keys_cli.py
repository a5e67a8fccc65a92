"""`kvtier keys add / list / revoke` on real files, and the keys file the server reads."""

from __future__ import annotations

import hashlib
import json
import os
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvtier import apikeys
from kvtier.errors import KeysFileError
from ops.cli import cli

REPO = Path(__file__).resolve().parents[2]


def keys(*args: str) -> tuple[int, str, str]:
    r = CliRunner().invoke(cli, ["keys", *args])
    return r.exit_code, r.stdout, r.stderr


def add(path: Path, tenant: str, *flags: str) -> str:
    code, out, err = keys("add", tenant, *flags, "--file", str(path))
    assert code == 0, err
    return out.strip()


def test_add_prints_the_key_once_and_stores_only_its_hash(tmp_path: Path) -> None:
    path = tmp_path / "keys.json"
    old = os.umask(0o022)  # a usual umask: the file is 0600 anyway
    try:
        key = add(path, "acme")
    finally:
        os.umask(old)
    assert key.startswith("kvt_") and len(key) == 4 + 8 + 1 + 43
    raw = path.read_text()
    secret = key.split("_", 2)[2]
    assert key not in raw and secret not in raw
    assert hashlib.sha256(key.encode()).hexdigest() in raw
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    # written through a temporary file and renamed: nothing but the file and its lock is left
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keys.json", "keys.json.lock"]
    # a second key for another tenant, an admin: the first one is kept
    admin = add(path, "ops", "--admin")
    ring = apikeys.load(path)
    assert [(r.tenant, r.admin) for r in ring.records] == [("acme", False), ("ops", True)]
    assert ring.lookup(key) == apikeys.Principal("acme", False, key[4:12])
    assert ring.lookup(admin) == apikeys.Principal("ops", True, admin[4:12])


def test_only_the_exact_key_authenticates(tmp_path: Path) -> None:
    path = tmp_path / "keys.json"
    key = add(path, "acme")
    ring = apikeys.load(path)
    flipped = key[:-1] + ("A" if key[-1] != "A" else "B")
    other_id = key[:4] + "00000000" + key[12:]
    for wrong in (flipped, other_id, key + "x", key[:-1], "", "Bearer " + key, key.upper()):
        assert ring.lookup(wrong) is None, wrong


def test_list_shows_ids_and_tenants_never_keys(tmp_path: Path) -> None:
    path = tmp_path / "keys.json"
    a, b = add(path, "acme"), add(path, "ops", "--admin")
    code, out, _ = keys("list", "--file", str(path))
    assert code == 0
    assert a not in out and b not in out
    lines = out.splitlines()
    assert lines[0].split()[:3] == ["ID", "TENANT", "ADMIN"]
    assert lines[1].split()[:3] == [a[4:12], "acme", "no"]
    assert lines[2].split()[:3] == [b[4:12], "ops", "yes"]
    code, out, _ = keys("list", "--json", "--file", str(path))
    rows = json.loads(out)["keys"]
    assert [(r["id"], r["tenant"], r["admin"]) for r in rows] == [
        (a[4:12], "acme", False),
        (b[4:12], "ops", True),
    ]
    assert "sha256" not in out


def test_revoke_by_id_by_key_and_by_tenant(tmp_path: Path) -> None:
    path = tmp_path / "keys.json"
    k1, k2, k3, k4 = (add(path, t) for t in ("acme", "acme", "beta", "gamma"))
    code, out, _ = keys("revoke", k1[4:12], "--file", str(path))
    assert code == 0 and k1[4:12] in out
    code, _, _ = keys("revoke", k4, "--file", str(path))  # the key itself names its id
    assert code == 0
    ring = apikeys.load(path)
    assert ring.lookup(k1) is None and ring.lookup(k4) is None and ring.lookup(k2) is not None
    code, out, _ = keys("revoke", "--tenant", "acme", "--file", str(path))
    assert code == 0
    ring = apikeys.load(path)
    assert [r.tenant for r in ring.records] == ["beta"] and ring.lookup(k3) is not None
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    code, _, err = keys("revoke", "ffffffff", "--file", str(path))
    assert code == 1 and "no key ffffffff" in err and "kvtier keys list" in err
    code, _, err = keys("revoke", "--file", str(path))
    assert code == 2 and "KEY_ID or --tenant" in err


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o620, 0o644])
def test_a_file_others_can_read_or_write_is_refused(tmp_path: Path, mode: int) -> None:
    path = tmp_path / "keys.json"
    key = add(path, "acme")
    path.chmod(mode)
    with pytest.raises(KeysFileError, match="chmod 600"):
        apikeys.load(path)
    for args in (("list",), ("add", "other"), ("revoke", key[4:12])):
        code, _, err = keys(*args, "--file", str(path))
        assert code == 1 and f"mode {mode:04o}" in err and f"chmod 600 {path}" in err
    path.chmod(0o600)
    assert [r.tenant for r in apikeys.load(path).records] == ["acme"]  # nothing was changed


def _file(keys_: list[dict[str, object]], **top: object) -> bytes:
    data = {"format": "kvtier-api-keys", "version": 1, "keys": keys_, **top}
    return json.dumps(data).encode()


GOOD = {"id": "0123abcd", "tenant": "acme", "admin": False, "sha256": "ab" * 32, "created": 1.0}
BAD_FILES = {
    "not JSON": b'{"format": ',
    "not ours": json.dumps({"keys": []}).encode(),
    "newer version": _file([], version=2),
    "keys not a list": _file([], keys={}),
    "missing field": _file([{k: v for k, v in GOOD.items() if k != "sha256"}]),
    "short hash": _file([{**GOOD, "sha256": "ab"}]),
    "bad id": _file([{**GOOD, "id": "xyz"}]),
    "admin not a bool": _file([{**GOOD, "admin": "yes"}]),
    "gateway not a bool": _file([{**GOOD, "gateway": "yes"}]),
    "reserved tenant": _file([{**GOOD, "tenant": "#kvtier"}]),
    "duplicate id": _file([GOOD, {**GOOD, "tenant": "beta"}]),
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_a_mangled_file_is_refused_with_its_reason(tmp_path: Path, case: str) -> None:
    path = tmp_path / "keys.json"
    path.write_bytes(BAD_FILES[case])
    path.chmod(0o600)
    with pytest.raises(KeysFileError, match="is not a kvtier keys file"):
        apikeys.load(path)
    code, _, err = keys("list", "--file", str(path))
    assert code == 1 and "not a kvtier keys file" in err


def test_gateway_keys_are_marked_and_older_files_read_as_before(tmp_path: Path) -> None:
    """`kvtier keys add NAME --gateway` marks the key a gateway's (the only kind whose X-Tenant
    the server honours with --trust-tenant-header); a file written before gateway keys existed
    has no such field, reads as it did (no gateway key) and stays readable after an add."""
    path = tmp_path / "keys.json"
    path.write_bytes(_file([GOOD]))  # the format as kvtier wrote it before gateway keys
    path.chmod(0o600)
    assert [(r.id, r.gateway) for r in apikeys.load(path).records] == [("0123abcd", False)]
    code, key, err = keys("add", "edge", "--gateway", "--file", str(path))
    assert code == 0 and "gateway key" in err, err
    key = key.strip()
    ring = apikeys.load(path)
    assert [(r.tenant, r.admin, r.gateway) for r in ring.records] == [
        ("acme", False, False),
        ("edge", False, True),
    ]
    assert ring.lookup(key) == apikeys.Principal("edge", False, key[4:12], gateway=True)
    tenant_key = add(path, "beta")  # a key without --gateway is not a gateway's
    principal = apikeys.load(path).lookup(tenant_key)
    assert principal == apikeys.Principal("beta", False, tenant_key[4:12], gateway=False)
    code, out, _ = keys("list", "--file", str(path))
    lines = out.splitlines()
    assert lines[0].split()[:4] == ["ID", "TENANT", "ADMIN", "GATEWAY"]
    assert lines[2].split()[:4] == [key[4:12], "edge", "no", "yes"]
    assert lines[3].split()[:4] == [tenant_key[4:12], "beta", "no", "no"]
    code, out, _ = keys("list", "--json", "--file", str(path))
    assert [r["gateway"] for r in json.loads(out)["keys"]] == [False, True, False]


def test_missing_file_and_bad_tenant_say_what_to_do(tmp_path: Path) -> None:
    path = tmp_path / "keys.json"
    code, _, err = keys("list", "--file", str(path))
    assert code == 1 and "does not exist" in err and "kvtier keys add" in err
    code, _, err = keys("add", "has space", "--file", str(path))
    assert code == 1 and "letters, digits" in err
    code, _, err = keys("add", "#kvtier", "--file", str(path))
    assert code == 1
    assert not path.exists()
    code, _, err = keys("add", "acme", "--file", str(tmp_path / "no" / "keys.json"))
    assert code == 1 and "does not exist" in err


def test_concurrent_adds_lose_no_key(tmp_path: Path) -> None:
    path = tmp_path / "keys.json"
    made: list[str] = []

    def adder(tenant: str) -> None:
        for _ in range(8):
            made.append(apikeys.add(path, tenant)[1])

    threads = [threading.Thread(target=adder, args=(t,)) for t in ("acme", "beta", "gamma")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ring = apikeys.load(path)
    assert len(ring) == 24 and all(ring.lookup(k) is not None for k in made)


def test_keys_command_loads_no_model_stack(tmp_path: Path) -> None:
    """`kvtier keys` starts as fast as `kvtier --help`: no torch, fastapi or server."""
    code = (
        "import sys, json\n"
        "from click.testing import CliRunner\n"
        "from ops.cli import cli\n"
        "r = CliRunner().invoke(cli, ['keys', 'add', 'acme', '--file', sys.argv[1]])\n"
        "assert r.exit_code == 0, r.output\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "k.json")],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    )
    loaded = set(json.loads(out.stdout.splitlines()[-1]))
    assert "kvtier.cli.keys" in loaded
    heavy = ("torch", "transformers", "fastapi", "uvicorn", "kvtier.server", "kvtier.cache")
    assert not [m for m in loaded if any(m == h or m.startswith(h + ".") for h in heavy)]
