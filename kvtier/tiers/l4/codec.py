"""L4 values: chunks as .kvbin bytes (the header L3 writes, then the payload, unpadded), and
session records as a checksummed JSON document. With an encrypted store both are sealed
(kvtier.tiers.l4.sealed): a chunk is a v2 .kvbin value whose checksum covers the ciphertext,
a record carries its token ids as nonce || ciphertext || tag and the id of the key.

A chunk read back is verified like an L3 read before any byte of it is used: the header's
checksum, its key, the payload length, the model fingerprint, the tenant, then (`expect`, the
chunk the reader asked for) that the header describes that chunk and nothing else: its tokens,
geometry, element type, codec and params, payload length and tenant (`kvbin.check_expected`);
last the payload's checksum. A value of the wrong shape is never read into a buffer that holds
another chunk's bytes past it. Both directions go through kvtier.kvbin's encode/decode, so a change of the chunk
encoding there (a new checksum, encryption) applies to L4 as it does to L3.
"""

from __future__ import annotations

import base64
import json
import struct
import zlib
from collections.abc import Collection
from dataclasses import replace
from typing import Any

from kvtier import kvbin
from kvtier.errors import FingerprintMismatch, KvbinFormatError
from kvtier.kvbin import HEADER_SIZE, ChunkHeader
from kvtier.tiers.l3.index import SessionRecord

RECORD_MAGIC = b"KVTSREC1"


def chunk_parts(header: ChunkHeader, payload: Any) -> tuple[bytes, memoryview]:
    """The value stored for a chunk in two parts, its .kvbin header (checksums filled in) and
    its payload (not copied): the store sends them as they are, Redis joins them."""
    view = memoryview(payload).cast("B")
    algo = header.checksum or kvbin.default_checksum()
    header = replace(header, checksum=algo, payload_len=len(view))
    return kvbin.encode(header, kvbin.checksum(algo, view)), view


def pack_chunk(header: ChunkHeader, payload: Any) -> bytes:
    """The value stored for a chunk: its .kvbin header + payload, in one piece."""
    return b"".join(chunk_parts(header, payload))


def unpack_chunk(
    value: Any,
    key: bytes,
    fingerprint: bytes,
    tenants: Collection[str] | None = None,
    expect: ChunkHeader | None = None,
) -> tuple[ChunkHeader, memoryview]:
    """Verify a chunk value read from Redis; returns its header and a view of its payload.

    Raises KvbinFormatError (or ChecksumMismatch) for anything malformed, damaged or not the
    chunk `expect` describes, and FingerprintMismatch for another model's chunk; `tenants`,
    when given, are the tenants the reader may be served (its own and the shared one)."""
    view = memoryview(value).cast("B")
    if len(view) < HEADER_SIZE:
        raise KvbinFormatError(f"L4 value of chunk {key.hex()} is {len(view)} bytes: truncated")
    header = kvbin.decode(view[:HEADER_SIZE])
    check_header(header, key, len(view) - HEADER_SIZE, fingerprint, tenants, expect)
    payload = view[HEADER_SIZE:]
    kvbin.verify_payload(header, payload)
    return header, payload


def check_header(
    header: ChunkHeader,
    key: bytes,
    payload_size: int,
    fingerprint: bytes,
    tenants: Collection[str] | None,
    expect: ChunkHeader | None = None,
) -> ChunkHeader:
    """The checks of a decoded header against what the reader asked for: `key`, the value's
    `payload_size`, the model, the tenants it may be served, and with `expect` the whole chunk
    (`kvbin.check_expected`). The payload's checksum is verified by the caller, over the
    bytes."""
    if header.key != key:
        raise KvbinFormatError(f"L4 value holds chunk {header.key.hex()}, not {key.hex()}")
    if header.fingerprint != fingerprint:
        raise FingerprintMismatch(
            f"L4 chunk {key.hex()} was written for model fingerprint {header.fingerprint.hex()}, "
            f"not {fingerprint.hex()}; it is never used for this model"
        )
    if expect is not None:
        kvbin.check_expected(header, expect)
    if header.payload_len != payload_size:
        raise KvbinFormatError(
            f"L4 value of chunk {key.hex()} has {payload_size} payload bytes, its "
            f"header says {header.payload_len} (truncated or overwritten)"
        )
    if tenants is not None and header.tenant not in tenants:
        raise KvbinFormatError(f"L4 chunk {key.hex()} belongs to another tenant")
    return header


def pack_record(rec: SessionRecord) -> bytes:
    rec.validate()
    doc = {
        "session_id": rec.session_id,
        "tenant": rec.tenant,
        "fingerprint": rec.fingerprint.hex(),
        "token_ids": base64.b64encode(rec.token_ids).decode("ascii"),
        "chunk_keys": [k.hex() for k in rec.chunk_keys],
        "pinned": rec.pinned,
        "ttl_s": rec.ttl_s,
        "last_active": rec.last_active,
        "state": rec.state,
        "key_id": None if rec.key_id is None else rec.key_id.hex(),
    }
    body = json.dumps(doc, separators=(",", ":")).encode("utf-8", "surrogatepass")
    return RECORD_MAGIC + struct.pack("<I", zlib.crc32(body)) + body


def unpack_record(value: bytes) -> SessionRecord:
    """A session record read from Redis; KvbinFormatError if it is damaged."""
    if len(value) < 12 or value[:8] != RECORD_MAGIC:
        raise KvbinFormatError("L4 session record has a bad magic (not a kvtier record)")
    (crc,) = struct.unpack_from("<I", value, 8)
    body = value[12:]
    if zlib.crc32(body) != crc:
        raise KvbinFormatError("L4 session record checksum mismatch")
    try:
        doc = json.loads(body.decode("utf-8", "surrogatepass"))
        rec = SessionRecord(
            session_id=str(doc["session_id"]),
            tenant=str(doc["tenant"]),
            fingerprint=bytes.fromhex(doc["fingerprint"]),
            token_ids=base64.b64decode(doc["token_ids"]),
            chunk_keys=tuple(bytes.fromhex(k) for k in doc["chunk_keys"]),
            pinned=bool(doc["pinned"]),
            ttl_s=None if doc["ttl_s"] is None else float(doc["ttl_s"]),
            last_active=float(doc["last_active"]),
            state=str(doc["state"]),
            key_id=None if doc.get("key_id") is None else bytes.fromhex(doc["key_id"]),
        )
        rec.validate()
    except (ValueError, KeyError, TypeError, OverflowError, RecursionError) as exc:
        # OverflowError: a number no float holds; RecursionError: JSON nested past the
        # parser's depth (both from a value anyone with access to Redis can write)
        raise KvbinFormatError(f"L4 session record is malformed: {exc}") from None
    return rec
