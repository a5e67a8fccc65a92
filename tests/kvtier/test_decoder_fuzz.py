"""Fuzzing the chunk decoders (issue 40): the .kvbin header, an L3 file read, and the L4 values
(a chunk unpacked whole, a chunk read off the wire into its slot, a session record).

Whatever the bytes (random, or a valid value mutated, with its checksums recomputed or not),
a decoder either returns the chunk the reader asked for, whole, or raises the typed error of a
bad value: `KvbinFormatError` (and its subclasses `ChecksumMismatch`, `UnsupportedVersion`),
`FingerprintMismatch` for another model's chunk, `MasterKeyRequired` for a sealed chunk on a
plain host. Never an IndexError, struct.error, UnicodeDecodeError, OverflowError or
RecursionError, and never a byte of the destination past what was read.
"""

from __future__ import annotations

import json
import struct
import tempfile
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kvtier import kvbin
from kvtier.errors import FingerprintMismatch, KvbinFormatError, MasterKeyRequired
from kvtier.kvbin import HEADER_SIZE, ChunkHeader
from kvtier.tiers.l3 import L3Store, SessionRecord
from kvtier.tiers.l4 import codec, wire

FP = bytes(range(100, 116))
KEY = bytes(range(16))
TENANT = "alpha"
TENANTS = (TENANT, "kvtier#shared")
EXPECT = ChunkHeader(
    key=KEY, parent=bytes(16), fingerprint=FP, tenant=TENANT, tokens=4, layers=2, kv_heads=2,
    head_dim=8, dtype="float32", codec="native", codec_params=b"\x01\x00\x00",
    payload_len=2 * 2 * 4 * 2 * 8 * 4, created=1_700_000_000.0,
)  # fmt: skip
PAYLOAD = bytes((i * 37 + 11) & 0xFF for i in range(EXPECT.payload_len))
SLOT = kvbin.padded(EXPECT.payload_len)
SENTINEL = 0xA5
TYPED = (KvbinFormatError, FingerprintMismatch)
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def value_of(h: ChunkHeader = EXPECT, payload: bytes = PAYLOAD) -> bytes:
    """A chunk's L4 value: its .kvbin header (checksums filled in) and its payload."""
    return codec.pack_chunk(h, payload)


def refit(data: bytearray, payload_crc: bool) -> None:
    """Recompute the header checksum (and with `payload_crc` the payload's) after a mutation, so
    the mutated fields meet the checks behind the checksums."""
    if len(data) < HEADER_SIZE:
        return
    code = (struct.unpack_from("<I", data, 12)[0] >> 12) & 0xF
    if code >= len(kvbin.CHECKSUMS) or kvbin.CHECKSUMS[code] not in kvbin.available_checksums():
        return
    algo = kvbin.CHECKSUMS[code]
    if payload_crc:
        n = struct.unpack_from("<Q", data, 96)[0]
        crc = kvbin.checksum(algo, bytes(data[HEADER_SIZE : HEADER_SIZE + n]))
        struct.pack_into("<I", data, 104, crc)
    struct.pack_into(
        "<I", data, HEADER_SIZE - 4, kvbin.checksum(algo, bytes(data[: HEADER_SIZE - 4]))
    )


# a mutation of a value: bytes flipped (mostly in the header's used part), the length cut or
# grown, then (or not) its checksums recomputed
flips = st.lists(
    st.tuples(
        st.one_of(st.integers(0, 479), st.integers(0, HEADER_SIZE + SLOT)), st.integers(1, 255)
    ),
    max_size=6,
)
resize = st.one_of(st.just(0), st.sampled_from([-SLOT, -1, 1, 4096]), st.integers(-5000, 5000))
refits = st.sampled_from(["none", "header", "both"])


def mutated(base: bytes, flip: list[tuple[int, int]], grow: int, fix: str) -> bytes:
    data = bytearray(base)
    for offset, mask in flip:
        if offset < len(data):
            data[offset] ^= mask
    if grow < 0:
        del data[max(0, len(data) + grow) :]
    else:
        data += bytes((i * 7) & 0xFF for i in range(grow))
    if fix != "none":
        refit(data, fix == "both")
    return bytes(data)


# field forgeries that keep a header self-consistent (the attack of issue 40, generalised)
forged_fields = st.fixed_dictionaries(
    {},
    optional={
        "tokens": st.integers(0, 2**32 - 1),
        "layers": st.integers(0, 64),
        "kv_heads": st.integers(0, 64),
        "head_dim": st.integers(0, 512),
        "dtype": st.sampled_from(kvbin.DTYPES),
        "codec": st.sampled_from(kvbin.CODECS),
        "codec_params": st.binary(max_size=8),
        "tenant": st.sampled_from([TENANT, "victim", "kvtier#shared", ""]),
        "key": st.sampled_from([KEY, bytes(16), bytes(range(1, 17))]),
        "fingerprint": st.sampled_from([FP, bytes(16)]),
        "cut": st.integers(0, EXPECT.payload_len),
    },
)


def forged(fields: dict[str, Any]) -> bytes:
    over = dict(fields)
    payload = PAYLOAD[: over.pop("cut", EXPECT.payload_len)]
    return value_of(ChunkHeader(**{**EXPECT.__dict__, **over}), payload)


def accepted_is_the_chunk(h: ChunkHeader) -> None:
    for name in kvbin.EXPECTED_FIELDS:
        assert getattr(h, name) == getattr(EXPECT, name), name
    assert h.tenant == TENANT


# -- .kvbin headers ------------------------------------------------------------------------------


@FUZZ
@given(flip=flips, fix=refits)
@example(flip=[(113, ord("l"))], fix="header")  # tenant "a\x00pha": `validate` refuses it
def test_mutated_headers_decode_to_a_storable_header_or_a_typed_error(
    flip: list[tuple[int, int]], fix: str
) -> None:
    data = mutated(value_of()[:HEADER_SIZE], flip, 0, fix)
    try:
        h = kvbin.decode(data)
    except KvbinFormatError:
        return
    h.validate()  # whatever decodes is a header `encode` takes back
    try:
        kvbin.check_expected(h, EXPECT)
    except KvbinFormatError:
        return
    accepted_is_the_chunk(h)


# -- L4: a value unpacked whole -----------------------------------------------------------------


@FUZZ
@given(data=st.binary(max_size=HEADER_SIZE + 64))
def test_random_l4_values_raise_only_typed_errors(data: bytes) -> None:
    with pytest.raises(KvbinFormatError):
        codec.unpack_chunk(data, KEY, FP, TENANTS, expect=EXPECT)


@FUZZ
@given(flip=flips, grow=resize, fix=refits)
@example(flip=[], grow=0, fix="none")
def test_mutated_l4_values_are_the_chunk_or_a_typed_error(
    flip: list[tuple[int, int]], grow: int, fix: str
) -> None:
    check_unpack(mutated(value_of(), flip, grow, fix))


@FUZZ
@given(fields=forged_fields)
@example(fields={"tokens": 2, "cut": EXPECT.payload_len // 2})  # the reported forgery
def test_forged_l4_values_are_refused_unless_they_are_the_chunk(fields: dict[str, Any]) -> None:
    try:
        data = forged(fields)
    except KvbinFormatError:
        return  # not even storable (an empty tenant is, a tenant of 65 bytes is not)
    check_unpack(data)


def check_unpack(data: bytes) -> None:
    try:
        h, payload = codec.unpack_chunk(data, KEY, FP, TENANTS, expect=EXPECT)
    except FingerprintMismatch:
        assert kvbin.decode(data[:HEADER_SIZE]).fingerprint != FP
        return
    except KvbinFormatError:
        return
    accepted_is_the_chunk(h)
    assert len(payload) == EXPECT.payload_len


# -- L4: a value read off the wire into its slot -------------------------------------------------


class _Sock:
    """What `wire.get_many` uses of a socket, over bytes already received."""

    def __init__(self, data: bytes) -> None:
        self.data = memoryview(data)

    def sendall(self, _out: bytes) -> None:
        pass

    def recv(self, n: int) -> bytes:
        out, self.data = bytes(self.data[:n]), self.data[n:]
        return out

    def recv_into(self, view: memoryview) -> int:
        n = min(len(view), len(self.data), 7919)  # in pieces, as a socket delivers them
        view[:n] = self.data[:n]
        self.data = self.data[n:]
        return n


class _Conn:
    def __init__(self, data: bytes) -> None:
        self._sock = _Sock(data)

    def can_read(self) -> bool:
        return False


def read_off_the_wire(values: list[bytes | None]) -> tuple[list[wire.Reply], list[bytearray]]:
    """`get_many` of one key per value (None: a nil reply), each into a slot of SENTINEL bytes."""
    replies = b"".join(b"$-1\r\n" if v is None else b"$%d\r\n%s\r\n" % (len(v), v) for v in values)
    slots = [bytearray([SENTINEL]) * SLOT for _ in values]
    out = wire.get_many(
        _Conn(replies),
        [f"c{i}" for i in range(len(values))],
        [KEY] * len(values),
        FP,
        TENANTS,
        lambda i, h: memoryview(slots[i]),
        RuntimeError,
        None,
        [EXPECT] * len(values),
    )
    return out, slots


@FUZZ
@given(flip=flips, grow=resize, fix=refits)
def test_mutated_values_on_the_wire_never_leave_a_slot_half_written(
    flip: list[tuple[int, int]], grow: int, fix: str
) -> None:
    bad = mutated(value_of(), flip, grow, fix)
    check_wire(bad)


@FUZZ
@given(fields=forged_fields)
@example(fields={"tokens": 2, "cut": EXPECT.payload_len // 2})
def test_forged_values_on_the_wire_never_leave_a_slot_half_written(fields: dict[str, Any]) -> None:
    try:
        data = forged(fields)
    except KvbinFormatError:
        return
    check_wire(data)


def check_wire(bad: bytes) -> None:
    # the mutated value between a nil and a valid value: the stream stays in step around it
    (nil, rep, good), (_, slot, good_slot) = read_off_the_wire([None, bad, value_of()])
    assert nil.header is None and nil.error is None
    assert good.error is None and good.header is not None
    assert bytes(good_slot[: EXPECT.payload_len]) == PAYLOAD
    if rep.error is not None:
        assert isinstance(rep.error, (*TYPED, MasterKeyRequired)), repr(rep.error)
        return
    assert rep.header is not None
    accepted_is_the_chunk(rep.header)
    n = rep.header.payload_len
    assert bytes(slot[:n]) == bad[HEADER_SIZE : HEADER_SIZE + n]  # all of it came from the value
    assert set(slot[n:]) <= {SENTINEL}  # nothing past it was written


# -- L3: a file read into an aligned buffer -----------------------------------------------------


@pytest.fixture(scope="module")
def store() -> Iterator[L3Store]:
    with tempfile.TemporaryDirectory() as d, L3Store(Path(d) / "l3") as s:
        yield s


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(flip=flips, grow=resize, fix=refits)
@example(flip=[], grow=0, fix="none")
def test_mutated_l3_files_are_the_chunk_or_a_typed_error(
    store: L3Store, flip: list[tuple[int, int]], grow: int, fix: str
) -> None:
    file = value_of() + bytes(SLOT - EXPECT.payload_len)  # padded as a .kvbin file is
    data = mutated(file, flip, grow, fix)
    path = store.path(KEY)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    buf = store.aligned_buffer(SLOT + 2 * 4096)
    buf[:] = bytes([SENTINEL]) * len(buf)
    try:
        h = store.get(KEY, buf, fingerprint=FP, expect=EXPECT)
    except TYPED:
        return
    accepted_is_the_chunk(h)
    assert bytes(buf[: h.payload_len]) == data[HEADER_SIZE : HEADER_SIZE + h.payload_len]


# -- L4: session records ----------------------------------------------------------------------


def record_value(body: bytes) -> bytes:
    return codec.RECORD_MAGIC + struct.pack("<I", zlib.crc32(body)) + body


VALID_DOC = json.loads(
    codec.pack_record(
        SessionRecord(
            "s1", TENANT, FP, struct.pack("<4i", 1, 2, 3, 4), (KEY,), False, None, 1.0, "hibernated"
        )
    )[12:]
)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


@FUZZ
@given(data=st.binary(max_size=200))
def test_random_records_raise_only_typed_errors(data: bytes) -> None:
    with pytest.raises(KvbinFormatError):
        codec.unpack_record(data)


@FUZZ
@given(field=st.sampled_from(sorted(VALID_DOC)), value=json_values)
@example(field="last_active", value=10**400)  # an int no float holds
@example(field="ttl_s", value=-(10**400))
def test_records_with_a_field_of_any_json_value_raise_only_typed_errors(
    field: str, value: Any
) -> None:
    body = json.dumps({**VALID_DOC, field: value}).encode()
    try:
        rec = codec.unpack_record(record_value(body))
    except KvbinFormatError:
        return
    rec.validate()


@FUZZ
@given(body=st.binary(max_size=300))
@example(body=b"[" * 100_000 + b"]" * 100_000)  # deeper than the JSON parser recurses
def test_records_of_any_body_with_a_valid_checksum_raise_only_typed_errors(body: bytes) -> None:
    try:
        codec.unpack_record(record_value(body))
    except KvbinFormatError:
        pass
