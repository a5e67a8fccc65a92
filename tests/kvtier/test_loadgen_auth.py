"""kvtier loadgen and kvtop against `kvtier serve --api-keys`: the key goes on every request,
the key's tenant owns the sessions, the recompute probes still find nothing cached (a nonce at
the start of the prompt, since the key allows one tenant only), and kvtop lists sessions with
an admin key."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
from server_proc import ROOT, Server

from kvtier import apikeys
from ops.kvtop.sources import HttpSource


def test_loadgen_with_an_api_key(tmp_path: Path) -> None:
    keys = tmp_path / "keys.json"
    key = apikeys.add(keys, "fleet")[1]
    admin = apikeys.add(keys, "ops", admin=True)[1]
    srv = Server(tmp_path / "l3", "--api-keys", str(keys), "--l1-bytes", "32MiB",
                 "--l2-bytes", "32MiB", module="ops.cli serve")  # fmt: skip
    try:
        srv.start(timeout=180)
        out, png = tmp_path / "r.json", tmp_path / "r.png"
        cmd = [sys.executable, "-m", "ops.cli", "loadgen", "--url", srv.url, "--sessions", "2"]
        cmd += ["--turns", "3", "--think-ms", "100", "--max-tokens", "4", "--system-chars", "600"]
        cmd += ["--compare", "2", "--out", str(out), "--png", str(png)]
        env = {**os.environ, "KVTIER_API_KEY": key}
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=400, env=env)
        assert done.returncode == 0, done.stdout + done.stderr
        result = json.loads(out.read_text())
        assert result["requests"] == 6 and result["ok"] == 6, result["errors"]
        pairs = result["compare"]["pairs"]
        assert pairs, result["compare"]  # the baselines found nothing cached
        assert all(p["source"] != "recompute" for p in pairs), pairs
        listing = httpx.get(
            srv.url + "/v1/sessions", headers={"Authorization": f"Bearer {admin}"}, timeout=10
        ).json()["data"]
        mine = {s["session_id"] for s in listing if s["tenant"] == "fleet"}
        assert len(mine) == 2, listing  # the key's tenant owns the sessions, not --tenant's

        # kvtop: an admin key gets the session list; none gets the metrics and says why not
        with_key = HttpSource(srv.url, api_key=admin).fetch()
        assert with_key.sessions is not None and with_key.detail is None
        assert {s.session_id for s in with_key.sessions.sessions} >= mine
        without = HttpSource(srv.url).fetch()
        assert without.sessions is None and "--api-key" in (without.detail or "")
        assert "kvtier_" in without.metrics

        # without the key every request is refused, and the run says so
        env.pop("KVTIER_API_KEY")
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=400, env=env)
        bad = json.loads(out.read_text()) if out.exists() else {}
        assert done.returncode != 0 or bad.get("ok") == 0, done.stdout + done.stderr
    finally:
        if srv.proc is not None:
            assert srv.stop() == 0
