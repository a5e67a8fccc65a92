"""kvtier: a tiered KV cache (GPU memory, pinned host RAM, SSD) for always-on agent services."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = ["CacheConfig", "TieredCache", "__version__"]

if TYPE_CHECKING:  # pragma: no cover
    from kvtier.cache import CacheConfig, TieredCache


def __getattr__(name: str) -> Any:
    # TieredCache pulls in torch; keep `import kvtier` (and the CLI's --help) light.
    if name in ("TieredCache", "CacheConfig"):
        from kvtier import cache

        return getattr(cache, name)
    raise AttributeError(f"module 'kvtier' has no attribute {name!r}")
