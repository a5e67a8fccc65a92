"""CacheIdentity: what names this cache's K/V: the model's geometry, its fingerprint, the codec.

Fixed for the cache's life. Every chunk a tier holds carries the fingerprint and the codec in
its header (`kvtier.kvbin`); `header` builds the header a chunk of the directory must have,
which every tier's reader checks a value against before a byte of it is used.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from kvtier.cache.keys import SHARED_TENANT, namespace
from kvtier.codecs import Codec, make_codec
from kvtier.geometry import KVGeometry, model_fingerprint, normalize_dtype
from kvtier.weights import weights_digest

if TYPE_CHECKING:  # pragma: no cover
    from kvtier.cache.config import CacheConfig
    from kvtier.cache.directory import Chunk
    from kvtier.kvbin import ChunkHeader


@dataclass(frozen=True)
class CacheIdentity:
    config: CacheConfig
    chunk_tokens: int
    geometry: KVGeometry
    fingerprint: bytes
    codec: Codec

    @classmethod
    def of(cls, config: CacheConfig, model: Any) -> CacheIdentity:
        dtype = normalize_dtype(getattr(model, "dtype", torch.float32))
        geometry = KVGeometry.from_config(model.config, dtype=dtype)
        model_id = config.model_id or getattr(model.config, "_name_or_path", "") or "unnamed"
        fingerprint = model_fingerprint(
            model.config,
            geometry,
            model_id=model_id,
            codec=config.codec,
            weights_digest=weights_digest(model),
        )
        codec = make_codec(config.codec, geometry)
        return cls(config, config.chunk_tokens, geometry, fingerprint, codec)

    @functools.cached_property
    def shared_ns(self) -> bytes:
        """The key namespace of prefixes published to every tenant."""
        return namespace(self.fingerprint, SHARED_TENANT)

    def header(self, entry: Chunk) -> ChunkHeader:
        """The header a stored copy of the directory's chunk `entry` must carry."""
        return self.codec.header(
            entry.key,
            entry.tokens,
            fingerprint=self.fingerprint,
            tenant=entry.tenant,
            parent=entry.parent,
        )
