"""End to end: the real `kvtop` console script inside tmux, watching the real exporter over a
live TieredCache workload on loopback. The screen (tmux capture-pane) must show what /metrics
says at that moment; keys must do what they say; q must exit; a dead endpoint must give a
message and retries, never a traceback."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from ops.kvtop import fmt, metrics
from ops.kvtop.model import STATES

REPO = Path(__file__).resolve().parents[2]
KVTOP = Path(sys.executable).parent / "kvtop"

pytestmark = pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")


class Tmux:
    """One detached tmux server (own socket) running one command in a 200x60 window."""

    def __init__(self, command: list[str], width: int = 200, height: int = 60) -> None:
        self.socket = f"kvtop-test-{os.getpid()}-{time.monotonic_ns()}"
        env = {**os.environ, "TERM": "xterm-256color"}
        env.pop("NO_COLOR", None)
        self._run(
            "new-session", "-d", "-s", "t", "-x", str(width), "-y", str(height),
            " ".join(command),
            env=env,
        )  # fmt: skip

    def _run(self, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["tmux", "-L", self.socket, *args],
            capture_output=True,
            text=True,
            timeout=10,
            env=env,
            check=False,
        )

    def screen(self) -> str:
        return self._run("capture-pane", "-p", "-t", "t").stdout

    def keys(self, *keys: str) -> None:
        self._run("send-keys", "-t", "t", *keys)

    def alive(self) -> bool:
        return self._run("has-session", "-t", "t").returncode == 0

    def wait(self, ok: Callable[[str], bool], timeout: float = 15.0) -> str:
        deadline = time.monotonic() + timeout
        text = ""
        while time.monotonic() < deadline:
            text = self.screen()
            if ok(text):
                return text
            time.sleep(0.1)
        raise AssertionError(f"screen never matched; last screen:\n{text}")

    def close(self) -> None:
        self._run("kill-server")


@pytest.fixture
def tmux_factory() -> Iterator[Callable[[list[str]], Tmux]]:
    made: list[Tmux] = []

    def make(command: list[str], width: int = 200, height: int = 60) -> Tmux:
        t = Tmux(command, width, height)
        made.append(t)
        return t

    yield make
    for t in made:
        t.close()


def scrape(url: str) -> metrics.Scrape:
    with urllib.request.urlopen(f"{url}/metrics", timeout=5) as r:
        return metrics.parse(r.read().decode(), time.monotonic())


def expected_l2(s: metrics.Scrape) -> tuple[str, str]:
    used = s.get("kvtier_tier_used_bytes", tier="l2")
    cap = s.get("kvtier_tier_capacity_bytes", tier="l2")
    return f"{fmt.size(used)}/{fmt.size(cap)}", fmt.count(s.get("kvtier_tier_chunks", tier="l2"))


def expected_states(s: metrics.Scrape) -> str:
    n = {st: int(s.get("kvtier_sessions", state=st) or 0) for st in ("active", "idle")}
    n |= {st: int(s.get("kvtier_sessions", state=st) or 0) for st in ("hibernated", "pinned")}
    return f"active {n['active']}  idle {n['idle']}  hibernated {n['hibernated']}  pinned {n['pinned']}"


def l2_row(screen: str) -> str:
    return next((line for line in screen.splitlines() if re.search(r"│ L2 ", line)), "")


@pytest.mark.slow
def _host_disk_nearly_full(path: Path) -> bool:
    """The filesystem under `path` (the test's L3) near the L3-filesystem alert's free-space
    threshold: a host filling its own disk then fires that alert, whatever the cache does."""
    from ops.thresholds import L3_FILESYSTEM

    st = os.statvfs(path)
    return st.f_bavail / st.f_blocks < L3_FILESYSTEM.value + 0.05


def test_kvtop_in_tmux_matches_metrics_and_obeys_keys(tmp_path: Path, tmux_factory) -> None:
    from test_kvtop_live import live_exporter

    with live_exporter(tmp_path) as live:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:  # wait for sessions in every tier
            s = scrape(live.url)
            if (s.get("kvtier_tier_chunks", tier="l2") or 0) > 0 and s.total("kvtier_sessions"):
                break
            time.sleep(0.2)
        tmux = tmux_factory([str(KVTOP), "--url", live.url, "--interval", "0.5"])
        tmux.wait(lambda t: "[2] Sessions" in t and "agent-" in t)

        # Freeze the workload, let the numbers settle, then the screen must equal /metrics.
        live.stop.set()
        matched = ""
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not matched:
            before = scrape(live.url)
            time.sleep(1.2)  # two refreshes of kvtop
            screen = tmux.screen()
            after = scrape(live.url)
            l2, chunks = expected_l2(after)
            if expected_l2(before) != (l2, chunks) or expected_states(before) != expected_states(
                after
            ):
                continue  # still moving (a write-through copy finishing): look again
            row = l2_row(screen)
            assert l2 in row and f" {chunks} " in row, (l2, chunks, screen)
            assert expected_states(after) in screen, (expected_states(after), screen)
            matched = screen
        assert matched, "the cache never settled after the workload stopped"
        assert "Traceback" not in matched
        if _host_disk_nearly_full(tmp_path):  # the host's own disk, not the cache's doing
            assert "alerts: none would fire now" in matched or "L3FilesystemFilling" in matched
        else:
            assert "alerts: none would fire now" in matched
        listed = sum(int(after.get("kvtier_sessions", state=st) or 0) for st in STATES)
        assert f"top {listed} of {listed} by bytes" in matched  # the list agrees with the gauges
        (tmp_path / "screen.txt").write_text(matched)
        live.stop.clear()

        tmux.keys("p")
        tmux.wait(lambda t: "PAUSED" in t)
        tmux.keys("p")
        tmux.wait(lambda t: "PAUSED" not in t)
        tmux.keys("s")
        tmux.wait(lambda t: "tokens ▼" in t and "bytes ▼" not in t)
        tmux.keys("4")
        tmux.wait(lambda t: "[4] Host (focused" in t and "[1] Tiers" not in t)
        tmux.keys("0", "?")
        tmux.wait(lambda t: "kvtop keys" in t)
        tmux.keys("Escape", "t", "a", "c", "m", "e", "Enter")
        tmux.wait(lambda t: "tenant acme" in t and "globex" not in t.split("[2] Sessions")[1])
        tmux.keys("q")
        deadline = time.monotonic() + 5
        while tmux.alive() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not tmux.alive(), tmux.screen()
        assert not live.errors, live.errors

    # No server at all: the L3 index the cache left behind, and this host's collectors.
    out = subprocess.run(
        [str(KVTOP), "--l3-root", str(tmp_path / "l3"), "--no-gpu", "--once", "--interval", "0.2"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "COLUMNS": "120", "LINES": "40"},
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert "[2] Sessions" in out.stdout and "agent-" in out.stdout and "hibernated" in out.stdout
    assert "l3-root" in out.stdout and "Traceback" not in out.stdout + out.stderr


def host_box(screen: list[str]) -> list[str]:
    """The inside of the `[4] Host` box of a captured screen."""
    top = next(i for i, line in enumerate(screen) if "╭─ [4] Host" in line)
    col = screen[top].index("╭─ [4] Host")
    out = []
    for line in screen[top + 1 :]:
        if line[col:].startswith("╰"):
            return out
        out.append(line[col + 1 :].split("│")[0].strip())
    raise AssertionError("the Host box does not close:\n" + "\n".join(screen))


@pytest.mark.slow
def test_kvtop_in_tmux_at_80x24_and_120x40_is_clean(tmp_path: Path, tmux_factory) -> None:
    """Sessions named as loadgen names them (one run id, then a number) stay distinct rows, and
    no Host field is cut, on this machine's real host signals at both sizes."""
    from test_kvtop_live import live_exporter

    with live_exporter(tmp_path, session_id="lg-ca4283a0-{i:05d}") as live:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and (scrape(live.url).total("kvtier_sessions") or 0) < 6:
            time.sleep(0.2)
        for width, height in ((80, 24), (120, 40)):
            tmux = tmux_factory([str(KVTOP), "--url", live.url, "--interval", "0.5"], width, height)
            text = tmux.wait(
                lambda t: len(re.findall(r"│ lg-", t)) >= 3 and "[4] Host" in t and "o9+" in t
            )
            screen = text.splitlines()
            assert len(screen) == height and all(len(line) <= width for line in screen)
            ids = [line.split()[1] for line in screen if line.startswith("│ lg-")]
            # at 80x24 the list gives rows to the restore table and says how many it shows
            assert len(set(ids)) == len(ids) >= 3, text
            shown = re.search(r"Sessions top (\d+) of", text)
            assert shown is None or int(shown.group(1)) == len(ids), text
            assert all(re.fullmatch(r"lg-.*-0000[0-5]", i) for i in ids), text
            assert "…" not in screen[0] and screen[0].rstrip().endswith("? help"), text
            box = host_box(screen)
            assert box and not any("…" in line for line in box), text
            assert "Traceback" not in text
            (tmp_path / f"screen-{width}x{height}.txt").write_text(text)
            tmux.keys("q")
        assert not live.errors, live.errors


def test_dead_endpoint_shows_a_message_and_keeps_retrying(tmux_factory) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    tmux = tmux_factory([str(KVTOP), "--url", f"http://127.0.0.1:{port}", "--interval", "0.3"])
    screen = tmux.wait(lambda t: "cannot reach" in t)
    assert f"127.0.0.1:{port}/metrics" in screen and "Traceback" not in screen
    assert "retrying every 0.3s" in screen
    time.sleep(1.0)
    assert tmux.alive() and "cannot reach" in tmux.screen()
    tmux.keys("q")
    deadline = time.monotonic() + 5
    while tmux.alive() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not tmux.alive()


def test_once_against_a_dead_endpoint_exits_1_with_the_reason() -> None:
    out = subprocess.run(
        [str(KVTOP), "--url", "http://127.0.0.1:9", "--once", "--interval", "0.1"],
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, "COLUMNS": "100", "LINES": "20"},
        check=False,
    )
    assert out.returncode == 1
    text = " ".join(out.stdout.split())
    assert "cannot reach http://127.0.0.1:9/metrics" in text
    # one frame and exit 1: it says so, and never that it keeps retrying
    assert "--once gives up (exit 1)" in text and "retrying" not in text
    assert "Traceback" not in out.stderr
