"""A real `kvtier serve` in a subprocess on a free loopback port (plain module for test_server*)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """Start with `Server(tmp_path, "--cache", "none").start()`; stop with `.stop()` (SIGTERM).
    `module` may carry a subcommand: `module="ops.cli serve"` runs `kvtier serve` (host metrics).
    `open_files` caps the process's open files (soft and hard RLIMIT_NOFILE) before it starts."""

    def __init__(
        self,
        l3_root: Path,
        *args: str,
        module: str = "kvtier.server",
        open_files: int | None = None,
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.l3_root = l3_root
        self.args = args
        self.module = module
        self.open_files = open_files
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = l3_root.parent / f"server-{self.port}.log"

    def start(self, timeout: float = 90.0) -> Server:
        path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
        env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
        env = {k: v for k, v in env.items() if not k.startswith("KVTIER_")}
        cmd = [sys.executable, "-m", *self.module.split(), "--port", str(self.port)]
        cmd += ["--l3-root", str(self.l3_root), "--log-level", "warning", *self.args]
        self._logf = open(self.log, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=self._logf, stderr=self._logf, preexec_fn=self._limit
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited {self.proc.returncode}:\n{self.output()}")
            try:
                if httpx.get(self.url + "/readyz", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.kill()
        raise RuntimeError(f"server not ready in {timeout}s:\n{self.output()}")

    def _limit(self) -> None:
        if self.open_files is not None:
            import resource

            resource.setrlimit(resource.RLIMIT_NOFILE, (self.open_files, self.open_files))

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM (graceful drain) and the exit status."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
            self._logf.close()
        return rc

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        if hasattr(self, "_logf"):
            self._logf.close()


def chat(
    url: str, sid: str, messages: list[dict[str, str]], max_tokens: int = 16
) -> httpx.Response:
    """A greedy chat completion of session `sid`; asserts it answered 200."""
    body = {"model": "default", "messages": messages, "temperature": 0, "max_tokens": max_tokens}
    r = httpx.post(
        url + "/v1/chat/completions", json=body, headers={"X-Session-ID": sid}, timeout=60
    )
    assert r.status_code == 200, r.text
    return r


def reply_text(r: httpx.Response) -> str:
    """The assistant's text of a non-streamed chat completion."""
    return str(r.json()["choices"][0]["message"]["content"])
