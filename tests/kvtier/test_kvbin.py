"""The .kvbin v1 header codec: exact round trip, typed errors for every malformation, fuzzing."""

from __future__ import annotations

import struct
import zlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier import kvbin
from kvtier.errors import ChecksumMismatch, KvbinFormatError, UnsupportedVersion
from kvtier.kvbin import FORMAT_VERSION, HEADER_SIZE, ChunkHeader


def make_header(**over: object) -> ChunkHeader:
    fields: dict[str, object] = {
        "key": bytes(range(16)),
        "parent": bytes(range(16, 32)),
        "fingerprint": bytes(range(100, 116)),
        "tenant": "acme-ä",
        "tokens": 200,
        "layers": 28,
        "kv_heads": 4,
        "head_dim": 128,
        "dtype": "float16",
        "codec": "int8",
        "codec_params": b"\x01scale-layout",
        "payload_len": 12345,
        "created": 1_700_000_000.25,
        "compression": "none",
    }
    fields.update(over)
    return ChunkHeader(**fields)  # type: ignore[arg-type]


@pytest.mark.parametrize("algo", kvbin.CHECKSUMS)
def test_every_field_round_trips(algo: str) -> None:
    h = make_header(checksum=algo)
    data = kvbin.encode(h, 0xDEADBEEF)
    assert len(data) == HEADER_SIZE == 4096
    assert data[:8] == kvbin.MAGIC
    assert struct.unpack_from("<H", data, 8)[0] == FORMAT_VERSION
    got = kvbin.decode(data)
    assert got == ChunkHeader(**{**h.__dict__, "payload_crc": 0xDEADBEEF})
    assert got.checksum == algo


def test_default_checksum_is_crc32c_when_available() -> None:
    assert kvbin.default_checksum() == "crc32c"
    assert kvbin.decode(kvbin.encode(make_header(), 0)).checksum == "crc32c"


@pytest.mark.parametrize("algo", kvbin.CHECKSUMS)
def test_checksum_algorithms_match_references(algo: str) -> None:
    data = b"123456789"
    # Standard check values: CRC-32C 0xE3069283, CRC-32 (zlib) 0xCBF43926.
    expected = {"crc32c": 0xE3069283, "crc32": zlib.crc32(data)}[algo]
    assert kvbin.checksum(algo, data) == expected
    assert kvbin.checksum(algo, memoryview(bytearray(data))) == expected


@pytest.mark.parametrize("algo", kvbin.CHECKSUMS)
def test_verify_payload(algo: str) -> None:
    payload = bytes(range(256)) * 10
    h = kvbin.decode(
        kvbin.encode(make_header(checksum=algo, payload_len=2560), kvbin.checksum(algo, payload))
    )
    kvbin.verify_payload(h, payload)
    bad = bytearray(payload)
    bad[1000] ^= 0x10
    with pytest.raises(ChecksumMismatch, match="payload checksum"):
        kvbin.verify_payload(h, bad)


def test_bit_flip_anywhere_in_header_is_detected() -> None:
    data = kvbin.encode(make_header(), 1)
    for offset in (0, 9, 12, 20, 40, 64, 80, 90, 100, 120, 200, 1000, 4091, 4093):
        bad = bytearray(data)
        bad[offset] ^= 0x04
        with pytest.raises(KvbinFormatError):
            kvbin.decode(bytes(bad))


def test_wrong_magic() -> None:
    bad = b"NOTKVBIN" + kvbin.encode(make_header(), 1)[8:]
    with pytest.raises(KvbinFormatError, match="magic"):
        kvbin.decode(bad)


def test_future_version_is_refused_with_a_clear_error() -> None:
    bad = bytearray(kvbin.encode(make_header(), 1))
    struct.pack_into("<H", bad, 8, max(kvbin.VERSIONS) + 1)
    with pytest.raises(UnsupportedVersion, match="upgrade kvtier"):
        kvbin.decode(bytes(bad))


def test_truncated_and_empty() -> None:
    data = kvbin.encode(make_header(), 1)
    for n in (0, 1, 8, 4095):
        with pytest.raises(KvbinFormatError, match="truncated"):
            kvbin.decode(data[:n])


def test_reserved_bits_rejected_even_with_valid_checksum() -> None:
    bad = bytearray(kvbin.encode(make_header(), 1))
    struct.pack_into("<I", bad, 12, struct.unpack_from("<I", bad, 12)[0] | 1 << 20)
    struct.pack_into("<I", bad, 4092, kvbin.checksum("crc32c", bytes(bad[:4092])))
    with pytest.raises(KvbinFormatError, match="reserved"):
        kvbin.decode(bytes(bad))


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("key", b"short"),
        ("parent", b"x" * 17),
        ("fingerprint", "not bytes"),
        ("tenant", "t" * 65),
        ("tenant", "é" * 33),  # 66 UTF-8 bytes
        ("tokens", -1),
        ("layers", 2**32),
        ("dtype", "int4"),
        ("codec", "zstd"),
        ("compression", "lz4"),
        ("codec_params", b"p" * 257),
        ("payload_len", -5),
        ("created", float("nan")),
        ("checksum", "md5"),
    ],
)
def test_encode_refuses_unstorable_fields(field: str, value: object) -> None:
    with pytest.raises(KvbinFormatError, match=field.split("_")[0]):
        kvbin.encode(make_header(**{field: value}), 0)


def test_padding() -> None:
    assert kvbin.padded(0) == 0
    assert kvbin.padded(1) == 4096
    assert kvbin.padded(4096) == 4096
    assert kvbin.file_size(57344 * 256) == 4096 + 57344 * 256


headers = st.builds(
    ChunkHeader,
    key=st.binary(min_size=16, max_size=16),
    parent=st.binary(min_size=16, max_size=16),
    fingerprint=st.binary(min_size=16, max_size=16),
    tenant=st.text(
        alphabet=st.characters(blacklist_characters="\x00", blacklist_categories=["Cs"]),
        max_size=16,
    ),
    tokens=st.integers(0, 2**32 - 1),
    layers=st.integers(0, 2**32 - 1),
    kv_heads=st.integers(0, 2**32 - 1),
    head_dim=st.integers(0, 2**32 - 1),
    dtype=st.sampled_from(kvbin.DTYPES),
    codec=st.sampled_from(kvbin.CODECS),
    codec_params=st.binary(max_size=256),
    payload_len=st.integers(0, 2**63 - 1),
    created=st.floats(allow_nan=False, allow_infinity=False),
    compression=st.sampled_from(kvbin.COMPRESSIONS),
    checksum=st.sampled_from(kvbin.CHECKSUMS),
)


@settings(max_examples=300, deadline=None)
@given(h=headers, crc=st.integers(0, 2**32 - 1))
def test_property_round_trip(h: ChunkHeader, crc: int) -> None:
    got = kvbin.decode(kvbin.encode(h, crc))
    assert got == ChunkHeader(**{**h.__dict__, "payload_crc": crc})


@settings(max_examples=500, deadline=None)
@given(data=st.binary(min_size=0, max_size=4200))
def test_fuzz_random_bytes_raise_only_typed_errors(data: bytes) -> None:
    with pytest.raises(KvbinFormatError):
        kvbin.decode(data)


@settings(max_examples=500, deadline=None)
@given(
    h=headers,
    flips=st.lists(st.tuples(st.integers(0, 4095), st.integers(1, 255)), min_size=1, max_size=8),
)
def test_fuzz_mutated_headers_never_decode_silently_wrong(
    h: ChunkHeader, flips: list[tuple[int, int]]
) -> None:
    data = bytearray(kvbin.encode(h, 7))
    for offset, mask in flips:
        data[offset] ^= mask
    try:
        got = kvbin.decode(bytes(data))
    except KvbinFormatError:
        return
    # The flips cancelled out (same byte flipped back): decode must then give the original.
    assert got == ChunkHeader(**{**h.__dict__, "payload_crc": 7})


@settings(max_examples=500, deadline=None)
@given(
    body=st.binary(min_size=4092 - 10, max_size=4092 - 10), algo=st.sampled_from(kvbin.CHECKSUMS)
)
def test_fuzz_random_fields_with_valid_checksum_raise_only_typed_errors(
    body: bytes, algo: str
) -> None:
    # Magic, version and a matching header checksum get the parser past its first gates, so the
    # field validation itself meets random values.
    data = bytearray(kvbin.MAGIC + struct.pack("<H", FORMAT_VERSION) + body + bytes(4))
    flags = struct.unpack_from("<I", data, 12)[0] & ~(0xF << 12)
    struct.pack_into("<I", data, 12, flags | kvbin.CHECKSUMS.index(algo) << 12)
    struct.pack_into("<I", data, 4092, kvbin.checksum(algo, bytes(data[:4092])))
    try:
        h = kvbin.decode(bytes(data))
    except KvbinFormatError:
        return
    h.validate()  # anything that decodes is a storable header
