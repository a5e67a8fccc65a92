"""L4: the shared tier on Redis (docs/architecture.md, "L4"). A session hibernated on one host
resumes on any host that shares the Redis: chunks are the .kvbin bytes L3 writes, verified on
every read, and session records live beside them."""

from kvtier.tiers.l4.breaker import Breaker
from kvtier.tiers.l4.keys import redact
from kvtier.tiers.l4.reads import ReadBatch
from kvtier.tiers.l4.store import L4Store

__all__ = ["Breaker", "L4Store", "ReadBatch", "redact"]
