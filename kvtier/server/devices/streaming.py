"""Degraded mode's attention sinks plus a sliding window (StreamingLLM), opt-in.

While a device is lost (kvtier.server.devices.failover) the page pool on the survivors holds fewer
tokens. By default the scheduler then admits fewer sessions at once (the others wait). With
`degraded_window` W > 0, a turn whose prompt is longer than `degraded_sinks` S + W instead runs
over the first S tokens (the attention sinks) and the last W tokens of the conversation, with
positions given anew inside that view (as StreamingLLM does), so it takes at most S + W +
max_tokens tokens of pages. Such a turn runs on a throwaway session: the session's stored KV is
never written with approximate values, and its next turn after the device is back restores the
exact prefix and recomputes the rest. Responses say so (`X-Kvtier-Streaming-Attention`,
`usage.kvtier.streaming`), and `kvtier_server_streaming_turns_total` counts such turns.

With `degraded_kv = "int8"` the page pool rebuilt on the survivors stores K/V as int8 with a
scale per (token, kv head) (kvtier.paged.quant), so the same bytes hold about twice the tokens
of fp16/bf16 (four times fp32); it is native again once every device is back. Such a pool's
K/V never reach a session's stored KV: a turn over it commits only the exact prefix it was
restored with, and its next turn recomputes the rest (exactly, once the pool is native).
Responses say so (`X-Kvtier-Degraded-KV: int8`, `usage.kvtier.degraded_kv`), and
`kvtier_server_int8_kv_turns_total` counts such turns.
"""

from __future__ import annotations

import dataclasses
import uuid
from typing import Any

from kvtier.server.config import ServerConfig

# '#' is outside what clients may send as a session id (kvtier.server.http.common), so no client's
# session can be one of these.
STREAMING_SESSION = "#streaming-"


def pool_kv(config: ServerConfig, degraded: bool) -> str:
    """How a page pool built now stores K/V: "int8" while a device is lost and `degraded_kv`
    is "int8", else "native"."""
    return "int8" if degraded and config.degraded_kv == "int8" else "native"


def streaming_ids(ids: list[int], sinks: int, window: int) -> list[int] | None:
    """The first `sinks` and the last `window` ids, or None when `ids` is no longer than that."""
    if window <= 0 or len(ids) <= sinks + window:
        return None
    return ids[:sinks] + ids[-window:]


def degrade(job: Any, devices: Any, config: ServerConfig) -> tuple[Any, tuple[int, int] | None]:
    """`job` as it runs now: unchanged, or (while degraded, with a window configured, for a
    prompt longer than sinks + window) over its sinks and window on a throwaway session."""
    window = config.degraded_window
    if devices is None or not devices.degraded or window <= 0:
        return job, None
    sinks = config.degraded_sinks
    ids = streaming_ids(list(job.prompt_ids), sinks, window)
    if ids is None:
        return job, None
    sid = STREAMING_SESSION + uuid.uuid4().hex
    return dataclasses.replace(job, session_id=sid, prompt_ids=tuple(ids), ephemeral=True), (
        sinks,
        window,
    )
