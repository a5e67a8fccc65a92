"""The tiered cache: `TieredCache`, its `Session`s and `CacheConfig`."""

from kvtier.cache.config import CacheConfig
from kvtier.cache.core import Session, TieredCache

__all__ = ["CacheConfig", "Session", "TieredCache"]
