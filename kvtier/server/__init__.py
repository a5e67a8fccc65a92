"""`kvtier serve`: an OpenAI-compatible HTTP server on transformers with the tiered KV cache.

`create_app` is loaded on first use, so that `kvtier serve --help` (which reads the flags from
kvtier.server.run) does not import torch, transformers and fastapi.
"""

from __future__ import annotations

from typing import Any

from kvtier.server.config import ServerConfig

__all__ = ["ServerConfig", "create_app"]


def __getattr__(name: str) -> Any:
    if name == "create_app":
        from kvtier.server.http.app import create_app

        return create_app
    raise AttributeError(f"module 'kvtier.server' has no attribute {name!r}")
