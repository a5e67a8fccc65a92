"""The .kvbin chunk format (v1 plain, v2 sealed): a pure codec of the 4096-byte header.

See docs/architecture.md, "Formats", and docs/kvbin-format.md.

A file is this header followed by the payload, padded with zeros to a multiple of 4096 so that
the payload can be read with O_DIRECT straight into an aligned buffer. docs/kvbin-format.md
describes every byte. This module does no I/O: the store in kvtier.tiers.l3 does.
"""

from __future__ import annotations

import math
import struct
import zlib
from dataclasses import dataclass
from typing import Any

from kvtier.errors import ChecksumMismatch, KvbinFormatError, UnsupportedVersion

_crc32c: Any
try:  # hardware-accelerated CRC-32C (SSE4.2 / ARMv8 CRC); optional, see CHECKSUMS below
    import crc32c as _crc32c
except ImportError:  # pragma: no cover - exercised on machines without the package
    _crc32c = None

MAGIC = b"\x89KVBIN\r\n"  # 0x89 catches 7-bit transfers, CR LF catches newline translation
FORMAT_VERSION = 1  # plain chunks; the version in every model fingerprint
SEALED_VERSION = 2  # v1 plus the AES-256-GCM fields (key id, nonce, tag); see docs
VERSIONS = (FORMAT_VERSION, SEALED_VERSION)
HEADER_SIZE = 4096
ALIGN = 4096
KEY_SIZE = 16
TENANT_MAX = 64
CODEC_PARAMS_MAX = 256

DTYPES: tuple[str, ...] = ("bfloat16", "float16", "float32")  # code = index + 1
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
CODECS: tuple[str, ...] = ("native", "int8", "fp8")  # code = index
COMPRESSIONS: tuple[str, ...] = ("none",)  # code = index; lossless codecs come later
CHECKSUMS: tuple[str, ...] = ("crc32c", "crc32")  # code = index; crc32 is zlib's (fallback)
ENCRYPTIONS: tuple[str, ...] = ("none", "aes-256-gcm")  # code = index; v2 files only for != 0
KEY_ID_SIZE, NONCE_SIZE, TAG_SIZE = 16, 12, 16

# Fixed part of the header, little-endian. Offsets are documented in docs/kvbin-format.md.
_FIXED = struct.Struct("<8sHHI16s16s16sIIIIBBHIdQII")
_TENANT_OFF = _FIXED.size  # 112
_PARAMS_OFF = _TENANT_OFF + TENANT_MAX  # 176
_USED_END = _PARAMS_OFF + CODEC_PARAMS_MAX  # 432
_KEY_ID_OFF = _USED_END  # v2: 432, id of the tenant data key that sealed the payload
_NONCE_OFF = _KEY_ID_OFF + KEY_ID_SIZE  # v2: 448, the AES-GCM nonce (96 bits, random)
_TAG_OFF = _NONCE_OFF + NONCE_SIZE  # v2: 460, the AES-GCM tag
_SEALED_END = _TAG_OFF + TAG_SIZE  # 476
_HCRC_OFF = HEADER_SIZE - 4  # 4092: header checksum over bytes [0, 4092)
_ZERO = bytes(HEADER_SIZE)

# Flag bits (u32 at offset 12).
_CODEC_SHIFT, _COMPRESSION_SHIFT, _ENCRYPTION_SHIFT, _CHECKSUM_SHIFT = 0, 4, 8, 12
_NIBBLE = 0xF
_KNOWN_FLAGS = 0xFFFF  # bits 16..31 are reserved and must be zero in v1


def available_checksums() -> tuple[str, ...]:
    """Checksum algorithms this process can compute, best first."""
    return CHECKSUMS if _crc32c is not None else ("crc32",)


def default_checksum() -> str:
    """CRC-32C where the accelerated package is importable, else zlib's CRC-32 (also GB/s)."""
    return available_checksums()[0]


def checksum(algo: str, data: Any, value: int = 0) -> int:
    """CRC of any buffer (bytes, memoryview, numpy array) with the named algorithm; pass the CRC
    of the bytes before `data` as `value` to continue it (checksum a payload piece by piece)."""
    if algo == "crc32c":
        if _crc32c is None:
            raise KvbinFormatError(
                "chunk checksummed with crc32c but the `crc32c` package is not installed; "
                "install it (pip install crc32c) to read this store"
            )
        return int(_crc32c.crc32c(data, value))
    if algo == "crc32":
        return zlib.crc32(data, value) & 0xFFFFFFFF
    raise ValueError(f"unknown checksum algorithm {algo!r}; use one of {CHECKSUMS}")


def padded(n: int) -> int:
    """`n` rounded up to the 4096-byte alignment unit."""
    return -(-n // ALIGN) * ALIGN


def file_size(payload_len: int) -> int:
    """Size of a .kvbin file holding `payload_len` payload bytes."""
    return HEADER_SIZE + padded(payload_len)


@dataclass(frozen=True)
class ChunkHeader:
    """Everything the header of a .kvbin file says about its chunk.

    `payload_crc` and `checksum` are filled by `decode` (and by the store after `put`); a header
    handed to `encode` may leave them at their defaults: encode computes both.
    """

    key: bytes  # 16 bytes
    parent: bytes  # 16 bytes, all zero for the first chunk of a sequence
    fingerprint: bytes  # 16 bytes, the model fingerprint
    tenant: str  # <= 64 bytes UTF-8
    tokens: int
    layers: int
    kv_heads: int
    head_dim: int
    dtype: str  # "bfloat16" | "float16" | "float32"
    codec: str  # "native" | "int8" | "fp8"
    codec_params: bytes  # opaque, <= 256 bytes
    payload_len: int
    created: float  # unix seconds
    compression: str = "none"
    checksum: str = ""  # payload/header checksum algorithm; "" = best available at encode
    payload_crc: int = 0  # set by decode
    # Encryption at rest (v2 files): the payload is AES-256-GCM ciphertext of the plain payload
    # (same length), sealed with the data key `key_id` under `nonce`; `tag` authenticates it
    # and `sealed_aad(header)`. Set by the sealing writer (kvtier.sealing), never by callers.
    encryption: str = "none"
    key_id: bytes = b""
    nonce: bytes = b""
    tag: bytes = b""

    def validate(self) -> None:
        """Raise KvbinFormatError naming the first field that cannot be stored in v1."""
        for name in ("key", "parent", "fingerprint"):
            value = getattr(self, name)
            if not isinstance(value, (bytes, bytearray)) or len(value) != KEY_SIZE:
                raise KvbinFormatError(f"{name} must be {KEY_SIZE} bytes, got {value!r:.60}")
        if not isinstance(self.tenant, str) or len(self.tenant.encode("utf-8")) > TENANT_MAX:
            raise KvbinFormatError(
                f"tenant must be a str of at most {TENANT_MAX} UTF-8 bytes; "
                "hash longer tenant names before storing them"
            )
        if "\x00" in self.tenant:
            raise KvbinFormatError("tenant must not contain NUL characters")
        for name in ("tokens", "layers", "kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or not 0 <= value < 2**32:
                raise KvbinFormatError(f"{name} must be an int in [0, 2**32), got {value!r}")
        if self.dtype not in DTYPES:
            raise KvbinFormatError(f"dtype {self.dtype!r} unknown; use one of {DTYPES}")
        if self.codec not in CODECS:
            raise KvbinFormatError(f"codec {self.codec!r} unknown; use one of {CODECS}")
        if self.compression not in COMPRESSIONS:
            raise KvbinFormatError(
                f"compression {self.compression!r} unknown; use one of {COMPRESSIONS}"
            )
        if self.checksum and self.checksum not in CHECKSUMS:
            raise KvbinFormatError(f"checksum {self.checksum!r} unknown; use one of {CHECKSUMS}")
        if not isinstance(self.codec_params, (bytes, bytearray)) or (
            len(self.codec_params) > CODEC_PARAMS_MAX
        ):
            raise KvbinFormatError(f"codec_params must be bytes of at most {CODEC_PARAMS_MAX}")
        if not isinstance(self.payload_len, int) or not 0 <= self.payload_len < 2**63:
            raise KvbinFormatError(
                f"payload_len must be a non-negative int, got {self.payload_len}"
            )
        if not isinstance(self.created, (int, float)) or not math.isfinite(self.created):
            raise KvbinFormatError(f"created must be finite unix seconds, got {self.created!r}")
        if self.encryption not in ENCRYPTIONS:
            raise KvbinFormatError(
                f"encryption {self.encryption!r} unknown; use one of {ENCRYPTIONS}"
            )
        sizes = (KEY_ID_SIZE, NONCE_SIZE, TAG_SIZE)
        if self.encryption != "none" and not all(
            isinstance(v, (bytes, bytearray)) and len(v) == n
            for v, n in zip((self.key_id, self.nonce, self.tag), sizes, strict=True)
        ):
            raise KvbinFormatError(
                "a sealed header needs a 16-byte key id, 12-byte nonce, 16-byte tag"
            )
        if self.encryption == "none" and (self.key_id or self.nonce or self.tag):
            raise KvbinFormatError("key id, nonce and tag are set but encryption is 'none'")

    @property
    def sealed(self) -> bool:
        """Whether the payload is ciphertext (a v2 file)."""
        return self.encryption != "none"


def sealed_aad(header: ChunkHeader) -> bytes:
    """The associated data an AES-GCM seal of this chunk's payload is bound to: every field
    that says what the payload is and whose it is (the chunk key, its parent, the model, the
    tenant, the data key, geometry, codec and length). A sealed payload moved under another
    key, tenant or header does not open."""
    tenant = header.tenant.encode("utf-8")
    return b"".join(
        (
            b"kvtier.kvbin.v2\x00",
            bytes(header.key),
            bytes(header.parent),
            bytes(header.fingerprint),
            bytes(header.key_id),
            struct.pack(
                "<IIIIBBHQB",
                header.tokens,
                header.layers,
                header.kv_heads,
                header.head_dim,
                DTYPES.index(header.dtype) + 1,
                CODECS.index(header.codec),
                len(header.codec_params),
                header.payload_len,
                len(tenant),
            ),
            bytes(header.codec_params),
            tenant,
        )
    )


def encode(header: ChunkHeader, payload_crc: int) -> bytes:
    """The 4096 header bytes for `header`, whose payload has CRC `payload_crc`.

    The checksum algorithm is `header.checksum`, or the best available when empty.
    """
    header.validate()
    algo = header.checksum or default_checksum()
    tenant = header.tenant.encode("utf-8")
    flags = (
        (CODECS.index(header.codec) << _CODEC_SHIFT)
        | (COMPRESSIONS.index(header.compression) << _COMPRESSION_SHIFT)
        | (ENCRYPTIONS.index(header.encryption) << _ENCRYPTION_SHIFT)
        | (CHECKSUMS.index(algo) << _CHECKSUM_SHIFT)
    )
    buf = bytearray(HEADER_SIZE)
    _FIXED.pack_into(
        buf,
        0,
        MAGIC,
        SEALED_VERSION if header.sealed else FORMAT_VERSION,
        HEADER_SIZE // ALIGN,  # header length in 4 KiB units
        flags,
        bytes(header.fingerprint),
        bytes(header.key),
        bytes(header.parent),
        header.tokens,
        header.layers,
        header.kv_heads,
        header.head_dim,
        DTYPES.index(header.dtype) + 1,
        len(tenant),
        len(header.codec_params),
        0,  # reserved
        float(header.created),
        header.payload_len,
        payload_crc & 0xFFFFFFFF,
        0,  # reserved
    )
    buf[_TENANT_OFF : _TENANT_OFF + len(tenant)] = tenant
    buf[_PARAMS_OFF : _PARAMS_OFF + len(header.codec_params)] = header.codec_params
    if header.sealed:
        buf[_KEY_ID_OFF:_NONCE_OFF] = header.key_id
        buf[_NONCE_OFF:_TAG_OFF] = header.nonce
        buf[_TAG_OFF:_SEALED_END] = header.tag
    struct.pack_into("<I", buf, _HCRC_OFF, checksum(algo, memoryview(buf)[:_HCRC_OFF]))
    return bytes(buf)


def decode(data: Any) -> ChunkHeader:
    """Parse and verify the first 4096 bytes of a .kvbin file.

    Raises only KvbinFormatError or its subclasses UnsupportedVersion and ChecksumMismatch,
    whatever the bytes are. The payload checksum is returned in `payload_crc` for the caller
    to verify against the payload (see `verify_payload`).
    """
    view = memoryview(data).cast("B")
    if len(view) < HEADER_SIZE:
        raise KvbinFormatError(
            f"truncated header: {len(view)} of {HEADER_SIZE} bytes; the file is incomplete"
        )
    view = view[:HEADER_SIZE]
    if bytes(view[:8]) != MAGIC:
        raise KvbinFormatError(f"bad magic {bytes(view[:8])!r}: not a .kvbin file")
    (version,) = struct.unpack_from("<H", view, 8)
    if version not in VERSIONS:
        raise UnsupportedVersion(
            f".kvbin format version {version}; this kvtier reads versions {VERSIONS} "
            "only: upgrade kvtier to read it, or delete the chunk"
        )
    (flags,) = struct.unpack_from("<I", view, 12)
    algo_code = (flags >> _CHECKSUM_SHIFT) & _NIBBLE
    if algo_code >= len(CHECKSUMS):
        raise KvbinFormatError(f"unknown checksum algorithm code {algo_code} in flags")
    algo = CHECKSUMS[algo_code]
    (stored,) = struct.unpack_from("<I", view, _HCRC_OFF)
    actual = checksum(algo, view[:_HCRC_OFF])
    if stored != actual:
        raise ChecksumMismatch(
            f"header checksum mismatch ({algo} stored {stored:08x}, computed {actual:08x})"
        )
    return _fields(view, flags, algo, version)


def _fields(view: memoryview, flags: int, algo: str, version: int) -> ChunkHeader:
    """Field validation of a header whose checksum is already verified."""
    (
        _magic,
        _version,
        units,
        _flags,
        fingerprint,
        key,
        parent,
        tokens,
        layers,
        kv_heads,
        head_dim,
        dtype_code,
        tenant_len,
        params_len,
        reserved1,
        created,
        payload_len,
        payload_crc,
        reserved2,
    ) = _FIXED.unpack_from(view, 0)
    if units != HEADER_SIZE // ALIGN:
        raise KvbinFormatError(f"header length {units} x 4096 unsupported in v1")
    if flags & ~_KNOWN_FLAGS or reserved1 or reserved2:
        raise KvbinFormatError(f"reserved flag bits or fields set (flags {flags:08x})")
    codec_code = (flags >> _CODEC_SHIFT) & _NIBBLE
    comp_code = (flags >> _COMPRESSION_SHIFT) & _NIBBLE
    enc_code = (flags >> _ENCRYPTION_SHIFT) & _NIBBLE
    if codec_code >= len(CODECS):
        raise KvbinFormatError(f"unknown codec code {codec_code}")
    if comp_code >= len(COMPRESSIONS):
        raise KvbinFormatError(f"unknown compression code {comp_code}")
    if enc_code >= len(ENCRYPTIONS):
        raise KvbinFormatError(f"encryption code {enc_code} is not supported by this reader")
    if (enc_code != 0) != (version == SEALED_VERSION):
        raise KvbinFormatError(
            f"version {version} with encryption code {enc_code}: v1 files are plain and v2 "
            "files sealed"
        )
    sealed_end = _SEALED_END if enc_code else _USED_END
    if not 1 <= dtype_code <= len(DTYPES):
        raise KvbinFormatError(f"unknown element type code {dtype_code}")
    if tenant_len > TENANT_MAX or params_len > CODEC_PARAMS_MAX:
        raise KvbinFormatError(f"tenant length {tenant_len} or codec params {params_len} too long")
    if payload_len >= 2**63 or not math.isfinite(created):
        raise KvbinFormatError("impossible payload length or created time")
    tenant_bytes = bytes(view[_TENANT_OFF : _TENANT_OFF + tenant_len])
    if (
        any(view[_TENANT_OFF + tenant_len : _PARAMS_OFF])
        or any(view[_PARAMS_OFF + params_len : _USED_END])
        or any(view[sealed_end:_HCRC_OFF])
    ):
        raise KvbinFormatError("non-zero bytes in the header's padding")
    if b"\x00" in tenant_bytes:  # never written (`validate` refuses it): not a tenant's name
        raise KvbinFormatError("tenant contains a NUL byte")
    try:
        tenant = tenant_bytes.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise KvbinFormatError(f"tenant is not valid UTF-8: {exc}") from None
    return ChunkHeader(
        key=key,
        parent=parent,
        fingerprint=fingerprint,
        tenant=tenant,
        tokens=tokens,
        layers=layers,
        kv_heads=kv_heads,
        head_dim=head_dim,
        dtype=DTYPES[dtype_code - 1],
        codec=CODECS[codec_code],
        codec_params=bytes(view[_PARAMS_OFF : _PARAMS_OFF + params_len]),
        payload_len=payload_len,
        created=created,
        compression=COMPRESSIONS[comp_code],
        checksum=algo,
        payload_crc=payload_crc,
        encryption=ENCRYPTIONS[enc_code],
        key_id=bytes(view[_KEY_ID_OFF:_NONCE_OFF]) if enc_code else b"",
        nonce=bytes(view[_NONCE_OFF:_TAG_OFF]) if enc_code else b"",
        tag=bytes(view[_TAG_OFF:_SEALED_END]) if enc_code else b"",
    )


# What a header read back must say to be the chunk the reader asked for (`check_expected`):
# its identity, its model, and everything that decides which bytes are its payload and how
# they are laid out. Not compared: the parent (a key already hashes it in), the creation time,
# the checksum algorithm and the sealing fields (the payload checks cover those).
EXPECTED_FIELDS = (
    "key",
    "fingerprint",
    "tokens",
    "layers",
    "kv_heads",
    "head_dim",
    "dtype",
    "codec",
    "codec_params",
    "compression",
    "payload_len",
)


def check_expected(header: ChunkHeader, expect: ChunkHeader) -> None:
    """Raise KvbinFormatError unless `header` (decoded and checksum-verified) describes the chunk
    `expect` describes: the same `EXPECTED_FIELDS`, and the same tenant unless `expect.tenant` is
    empty (a reader that does not know whose chunk it reads).

    A header's checksum says only that the header was not damaged; anyone who can write a tier
    can write a header that is self-consistent. Every reader that knows what it asked for
    checks this before a byte of the payload is used: a header that passes names exactly the
    bytes the caller will use (a shorter payload would leave the rest of the caller's buffer,
    whatever an earlier chunk left there, taken for part of this one)."""
    bad = [name for name in EXPECTED_FIELDS if getattr(header, name) != getattr(expect, name)]
    if expect.tenant and header.tenant != expect.tenant:
        bad.append("tenant")
    if bad:
        said = ", ".join(f"{n} {_shown(getattr(header, n))} (not {_shown(getattr(expect, n))})"
                         for n in bad)  # fmt: skip
        raise KvbinFormatError(
            f"header of chunk {bytes(expect.key).hex()} does not describe the chunk asked for: "
            f"{said}; forged or misplaced, never used (recompute instead)"
        )


def _shown(value: Any) -> str:
    if isinstance(value, (bytes, bytearray)):
        return bytes(value).hex() or "''"
    return repr(value)


def verify_payload(header: ChunkHeader, payload: Any) -> None:
    """Raise ChecksumMismatch unless `payload` (exactly payload_len bytes) matches the header."""
    verify_crc(header, checksum(header.checksum, payload))


def verify_crc(header: ChunkHeader, actual: int) -> None:
    """Raise ChecksumMismatch unless `actual` (the CRC computed over the payload) is stored."""
    if actual != header.payload_crc:
        raise ChecksumMismatch(
            f"payload checksum mismatch ({header.checksum} stored {header.payload_crc:08x}, "
            f"computed {actual:08x})"
        )
