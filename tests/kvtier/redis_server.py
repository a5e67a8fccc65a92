"""A real redis-server for the L4 tests: a free loopback port, a temp dir, stopped after."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

REDIS_SERVER = shutil.which("redis-server")


def need_redis() -> None:
    if REDIS_SERVER is None:
        pytest.skip("redis-server is not installed (scripts/bootstrap.sh dev installs it)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RedisServer:
    """One redis-server process; `kill()` and `start()` again keep the port (a restart)."""

    def __init__(self, root: Path, *extra: str) -> None:
        need_redis()
        self.root = root
        self.root.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.extra = extra
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        assert REDIS_SERVER is not None
        args = [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1"]
        args += ["--dir", str(self.root), "--save", "", "--appendonly", "no"]
        args += ["--protected-mode", "no", *self.extra]
        log = open(self.root / "redis.log", "ab")  # noqa: SIM115 - the process owns it
        self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(64).startswith(b"+PONG"):
                        return
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"redis-server did not start; see {self.root / 'redis.log'}")

    def kill(self) -> None:
        """SIGKILL: the data is gone (no persistence), clients see a reset connection."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(10)
            self.proc = None

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
            self.proc = None

    def client(self):
        import redis

        return redis.Redis(port=self.port)
