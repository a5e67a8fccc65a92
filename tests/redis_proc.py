"""A real `redis-server` for tests: started on a free loopback port in a directory of its own,
with extra configuration arguments, stopped (or killed, for fault tests) afterwards.

    with RedisServer(tmp_path / "redis", "--maxmemory", "64mb") as redis:
        use(redis.url)          # redis://127.0.0.1:PORT/0
        redis.kill()            # SIGKILL, as a crash
        redis.start()           # again, on the same port and directory

`tests/conftest.py` offers it as the `redis_server` fixture. No Python client is needed: readiness
is checked with a PING over a plain socket.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

BINARY = "redis-server"


def available() -> bool:
    return shutil.which(BINARY) is not None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def ping(port: int, timeout: float = 0.5) -> bool:
    """True when a Redis on 127.0.0.1:`port` answers PING: PONG, or a refusal that needs a
    password (NOAUTH) from a server started with --requirepass."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
            s.sendall(b"*1\r\n$4\r\nPING\r\n")
            return s.recv(64).startswith((b"+PONG", b"-NOAUTH"))
    except OSError:
        return False


class RedisServer:
    """One redis-server process. Persistence is off (no RDB, no AOF) unless `config` turns it on;
    `config` is passed as command-line arguments (`"--maxmemory", "64mb"`)."""

    def __init__(self, directory: Path, *config: str, port: int | None = None) -> None:
        self.dir = Path(directory)
        self.config = config
        self.port = port or free_port()
        self.fixed_port = port is not None
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = self.dir / "redis.log"

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def command(self) -> list[str]:
        return [
            BINARY,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--dir", str(self.dir),
            "--logfile", str(self.log),
            "--save", "",
            "--appendonly", "no",
            "--daemonize", "no",
            *self.config,
        ]  # fmt: skip

    def start(self, timeout: float = 15.0) -> RedisServer:
        """Start and wait for PING; a port taken meanwhile is replaced by another free one
        (unless the port was given)."""
        if not available():
            raise RuntimeError(f"{BINARY} is not installed: run scripts/bootstrap.sh dev")
        self.dir.mkdir(parents=True, exist_ok=True)
        fixed = self.fixed_port or self.proc is not None  # a restart keeps its port
        for _attempt in range(3):
            self.proc = subprocess.Popen(
                self.command(), stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT
            )
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                if ping(self.port):
                    return self
                if self.proc.poll() is not None:
                    break
                time.sleep(0.02)
            else:
                self.kill()
                raise RuntimeError(f"redis-server not ready in {timeout}s:\n{self.output()}")
            if fixed or "Address already in use" not in self.output():
                raise RuntimeError(f"redis-server exited {self.proc.returncode}:\n{self.output()}")
            self.port = free_port()
        raise RuntimeError(f"redis-server found no free port:\n{self.output()}")

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM and wait (SIGKILL past `timeout`)."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()

    def kill(self) -> None:
        """SIGKILL, as a crash: whatever was not persisted is gone."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
