"""`kvtier serve`: an OpenAI-compatible HTTP server on transformers with the tiered KV cache."""

from __future__ import annotations

from kvtier.server.app import create_app
from kvtier.server.config import ServerConfig

__all__ = ["ServerConfig", "create_app"]
