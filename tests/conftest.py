"""Fixtures shared by every test directory (this directory is on sys.path for their helpers)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from redis_proc import RedisServer, available


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A real redis-server on a free loopback port, stopped after the test."""
    if not available():
        pytest.skip("redis-server missing: `scripts/bootstrap.sh dev` installs it")
    server = RedisServer(tmp_path / "redis").start()
    try:
        yield server
    finally:
        server.stop()
