"""Encryption at rest: the master key, tenant data keys, and sealing of chunk payloads and
session records with AES-256-GCM (docs/security.md, docs/kvbin-format.md "Version 2").

- The master key (32 bytes in a file of mode 0600) never seals data. It wraps each tenant's
  data key (AES-256-GCM, bound to the tenant and the key id) and names itself by a key id
  (an HMAC of a fixed label, never the key) that the store records, so a wrong key is refused
  before anything is read.
- A data key (32 random bytes, one per tenant, id 16 random bytes) seals that tenant's chunk
  payloads and session token ids. Destroying its wrapped copy (crypto-shred) makes every chunk
  and record it sealed unreadable at once.
- A chunk payload is sealed as one AES-GCM message under a random 96-bit nonce, with the
  header's identity (`kvbin.sealed_aad`) as associated data; the ciphertext has the payload's
  length, so files, L2 slots and O_DIRECT alignment are the same as for plain chunks. The tag
  and nonce sit in the v2 header. A tag that does not verify raises `AuthenticationFailed`,
  a `ChecksumMismatch`: the store quarantines the chunk and the cache recomputes it.

This module is the encode/decode step of a stored chunk: any tier that stores encoded chunks
(`encode_chunk` / `decode_chunk` give the whole file's bytes) seals and opens them here.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import stat
import struct
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from kvtier import kvbin
from kvtier.errors import AuthenticationFailed, EncryptionError, KvbinFormatError, MasterKeyError
from kvtier.kvbin import HEADER_SIZE, KEY_ID_SIZE, NONCE_SIZE, TAG_SIZE, ChunkHeader

KEY_BYTES = 32  # AES-256
ALGORITHM = "aes-256-gcm"
_KEY_ID_LABEL = b"kvtier master key id v1"
_WRAP_AAD = b"kvtier.tenant-key.v1\x00"
_RECORD_AAD = b"kvtier.session.v1\x00"
MASTER_KEY_HELP = (
    "create one with: (umask 077; head -c 32 /dev/urandom > PATH), keep a copy off the host, "
    "and pass --master-key-file PATH (or KVTIER_MASTER_KEY_FILE)"
)


def _crypto() -> Any:
    """The `cryptography` package's AEAD pieces, imported on first use: a store without
    encryption works where the package is missing, and encryption says what to install."""
    try:
        from cryptography import exceptions
        from cryptography.hazmat.primitives.ciphers import Cipher, aead, algorithms, modes
    except ImportError as exc:  # pragma: no cover - the package is a dependency
        raise EncryptionError(
            f"encryption at rest needs the `cryptography` package ({exc}); "
            "pip install 'cryptography>=46'"
        ) from None
    return aead.AESGCM, Cipher, algorithms, modes, exceptions.InvalidTag


def _aesgcm(secret: bytes) -> Any:
    return _crypto()[0](secret)


@dataclass(frozen=True)
class MasterKey:
    """The store's key-encryption key. `key_id` (hex) is what the store records."""

    secret: bytes
    source: str = ""  # where it was read from, for messages

    def __post_init__(self) -> None:
        if len(self.secret) != KEY_BYTES:
            raise MasterKeyError(f"a master key is {KEY_BYTES} bytes, got {len(self.secret)}")

    def __repr__(self) -> str:
        return f"MasterKey(key_id={self.key_id!r}, source={self.source!r})"

    @property
    def key_id(self) -> str:
        return hmac.new(self.secret, _KEY_ID_LABEL, hashlib.sha256).hexdigest()[:32]

    def wrap(self, tenant: str, key_id: bytes, data_key: bytes) -> bytes:
        """The data key sealed for storage: nonce || ciphertext || tag (60 bytes)."""
        nonce = os.urandom(NONCE_SIZE)
        return nonce + _aesgcm(self.secret).encrypt(nonce, data_key, _wrap_aad(tenant, key_id))

    def unwrap(self, tenant: str, key_id: bytes, wrapped: bytes) -> DataKey:
        try:
            secret = _aesgcm(self.secret).decrypt(
                wrapped[:NONCE_SIZE], wrapped[NONCE_SIZE:], _wrap_aad(tenant, key_id)
            )
        except _crypto()[4]:
            raise AuthenticationFailed(
                f"the data key of tenant {tenant!r} does not open with master key "
                f"{self.key_id}: the index row was altered or written under another master key"
            ) from None
        return DataKey(bytes(key_id), tenant, secret)


def _wrap_aad(tenant: str, key_id: bytes) -> bytes:
    return _WRAP_AAD + bytes(key_id) + tenant.encode("utf-8")


@dataclass(frozen=True)
class DataKey:
    """One tenant's data key. Picklable (the L3 writer process gets it with each write)."""

    key_id: bytes
    tenant: str
    secret: bytes

    def __repr__(self) -> str:  # never the secret
        return f"DataKey(key_id={self.key_id.hex()!r}, tenant={self.tenant!r})"

    @staticmethod
    def new(tenant: str) -> DataKey:
        return DataKey(os.urandom(KEY_ID_SIZE), tenant, os.urandom(KEY_BYTES))


def load_master_key(path: str | os.PathLike[str]) -> MasterKey:
    """Read a master key file: 32 raw bytes, or 64 hex digits (whitespace ignored).

    The file must be a regular file that only its owner can read (mode 0600 or 0400):
    anything else is refused with `MasterKeyError` naming the fix."""
    p = Path(path)
    try:
        st = os.stat(p)
    except FileNotFoundError:
        raise MasterKeyError(f"master key file {p} does not exist; {MASTER_KEY_HELP}") from None
    except OSError as exc:
        raise MasterKeyError(f"master key file {p} cannot be read ({exc})") from None
    if not stat.S_ISREG(st.st_mode):
        raise MasterKeyError(f"master key file {p} is not a regular file")
    if st.st_mode & 0o077:
        raise MasterKeyError(
            f"master key file {p} has mode {stat.S_IMODE(st.st_mode):04o}: group or others "
            f"may read it; run `chmod 600 {p}` (only its owner may read a master key)"
        )
    try:
        data = p.read_bytes()
    except OSError as exc:
        raise MasterKeyError(f"master key file {p} cannot be read ({exc})") from None
    if len(data) != KEY_BYTES:
        text = b"".join(data.split())
        try:
            data = bytes.fromhex(text.decode("ascii"))
        except (UnicodeDecodeError, ValueError):
            data = b""
        if len(data) != KEY_BYTES:
            raise MasterKeyError(
                f"master key file {p} holds neither {KEY_BYTES} raw bytes nor "
                f"{2 * KEY_BYTES} hex digits; {MASTER_KEY_HELP}"
            )
    return MasterKey(data, str(p))


# ---- chunk payloads -----------------------------------------------------------------------


def seal_payload(key: DataKey, header: ChunkHeader, payload: Any, out: memoryview) -> ChunkHeader:
    """Encrypt `payload` into `out` (at least payload_len + 16 bytes, never overlapping the
    payload) and return the header that describes the sealed chunk (v2: key id, nonce, tag).
    The caller's payload is left as it was (L2 keeps plaintext)."""
    n = header.payload_len
    if len(out) < n + TAG_SIZE:
        raise ValueError(f"seal buffer has {len(out)} bytes, needs {n + TAG_SIZE}")
    nonce = os.urandom(NONCE_SIZE)
    sealed = replace(
        header, encryption=ALGORITHM, key_id=key.key_id, nonce=nonce, tag=bytes(TAG_SIZE)
    )
    aes, aad = _aesgcm(key.secret), kvbin.sealed_aad(sealed)
    if hasattr(aes, "encrypt_into"):  # cryptography >= 46: straight into the staging buffer
        aes.encrypt_into(nonce, payload, aad, out[: n + TAG_SIZE])
    else:  # pragma: no cover - older packages: one more copy
        out[: n + TAG_SIZE] = aes.encrypt(nonce, bytes(payload), aad)
    return replace(sealed, tag=bytes(out[n : n + TAG_SIZE]))


class PayloadSealer:
    """Encrypts a payload piece by piece, in order, into a separate buffer, so that the pieces
    already sealed can be written while the next is sealed; `finish` gives the header with the
    tag. The same ciphertext as `seal_payload` (one GCM message)."""

    def __init__(self, key: DataKey, header: ChunkHeader) -> None:
        _, Cipher, algorithms, modes, _ = _crypto()
        self.header = replace(
            header,
            encryption=ALGORITHM,
            key_id=key.key_id,
            nonce=os.urandom(NONCE_SIZE),
            tag=bytes(TAG_SIZE),
        )
        self._enc = Cipher(algorithms.AES(key.secret), modes.GCM(self.header.nonce)).encryptor()
        self._enc.authenticate_additional_data(kvbin.sealed_aad(self.header))

    def update(self, src: memoryview, dst: memoryview, start: int, end: int) -> None:
        """Seal src[start:end] into dst[start:end]; dst needs 15 bytes of room past `end`."""
        n = self._enc.update_into(src[start:end], dst[start : end + 15])
        if n != end - start:  # pragma: no cover - GCM is a stream mode
            raise KvbinFormatError(f"encrypted {n} of {end - start} bytes")

    def finish(self) -> ChunkHeader:
        self._enc.finalize()
        return replace(self.header, tag=bytes(self._enc.tag))


# Bytes decrypted at a time through the opener's scratch buffer: small enough to stay in the
# CPU's cache for the copy back, large enough that the calls' overhead does not show.
SCRATCH = 1 << 20


class PayloadOpener:
    """Decrypts a sealed payload in place, piece by piece in order, as its reads land; `finish`
    verifies the tag. Nothing decrypted may be used before `finish` returned."""

    def __init__(self, key: DataKey, header: ChunkHeader) -> None:
        if header.key_id != key.key_id or header.tenant != key.tenant:
            raise AuthenticationFailed(
                f"chunk names data key {header.key_id.hex()} of tenant {header.tenant!r}, "
                f"not {key.key_id.hex()} of {key.tenant!r}"
            )
        _, Cipher, algorithms, modes, self._invalid = _crypto()
        self._dec = Cipher(
            algorithms.AES(key.secret), modes.GCM(header.nonce, header.tag)
        ).decryptor()
        self._dec.authenticate_additional_data(kvbin.sealed_aad(header))
        self._scratch: bytearray | None = None

    def update(self, buf: memoryview, start: int, end: int) -> None:
        """Decrypt buf[start:end] in place. The cipher may not write over its input
        (cryptography 51 refuses overlapping buffers), so each piece of up to `SCRATCH` bytes
        is decrypted into a scratch buffer (15 bytes of room past the piece, as the cipher
        asks) and copied back."""
        n = 0
        for a in range(start, end, SCRATCH):
            b = min(a + SCRATCH, end)
            if self._scratch is None or len(self._scratch) < b - a + 15:
                self._scratch = bytearray(min(SCRATCH, end - start) + 15)
            got = self._dec.update_into(buf[a:b], self._scratch)
            buf[a : a + got] = memoryview(self._scratch)[:got]
            n += got
        if n != end - start:  # pragma: no cover - GCM is a stream mode
            raise KvbinFormatError(f"decrypted {n} of {end - start} bytes")

    def finish(self) -> None:
        try:
            self._dec.finalize()
        except self._invalid:
            raise AuthenticationFailed(
                "AES-GCM tag mismatch: the sealed payload or its header was altered"
            ) from None


def open_payload(key: DataKey, header: ChunkHeader, buf: memoryview) -> None:
    """Decrypt a whole sealed payload (buf[:payload_len]) in place and verify its tag."""
    opener = PayloadOpener(key, header)
    if header.payload_len:
        opener.update(buf, 0, header.payload_len)
    opener.finish()


def encode_chunk(
    header: ChunkHeader, payload: Any, key: DataKey | None = None, *, checksum: str = ""
) -> bytes:
    """A chunk's stored bytes (header + padded payload, exactly a .kvbin file): sealed with
    `key` when given, else plain. For tiers that keep encoded chunks other than as files."""
    view = memoryview(payload).cast("B")
    header = replace(header, payload_len=len(view), checksum=checksum or header.checksum)
    header.validate()
    out = bytearray(HEADER_SIZE + kvbin.padded(len(view)) + TAG_SIZE)
    body = memoryview(out)[HEADER_SIZE:]
    if key is not None:
        header = seal_payload(key, header, view, body)
    else:
        body[: len(view)] = view
    body[len(view) :] = bytes(len(body) - len(view))
    algo = header.checksum or kvbin.default_checksum()
    header = replace(header, checksum=algo)
    crc = kvbin.checksum(algo, body[: len(view)])
    body.release()
    out[:HEADER_SIZE] = kvbin.encode(header, crc)
    return bytes(memoryview(out)[: HEADER_SIZE + kvbin.padded(len(view))])


def decode_chunk(
    data: Any,
    *,
    chunk_key: bytes,
    fingerprint: bytes,
    keys: Callable[[ChunkHeader], DataKey] | None = None,
) -> tuple[ChunkHeader, bytes]:
    """Verify and open bytes made by `encode_chunk` (or read from a .kvbin file): header
    checksum, key, fingerprint, payload checksum, then the GCM tag with `keys(header)`.
    Raises the store's typed errors (KvbinFormatError and subclasses, FingerprintMismatch,
    MasterKeyRequired / TenantKeyShredded from `keys`)."""
    from kvtier.errors import FingerprintMismatch, MasterKeyRequired

    view = memoryview(data).cast("B")
    header = kvbin.decode(view[:HEADER_SIZE])
    if header.key != bytes(chunk_key):
        raise KvbinFormatError(f"bytes hold chunk {header.key.hex()}, not {bytes(chunk_key).hex()}")
    if len(view) != kvbin.file_size(header.payload_len):
        raise KvbinFormatError(f"{len(view)} bytes for a payload of {header.payload_len}")
    if header.fingerprint != bytes(fingerprint):
        raise FingerprintMismatch("chunk belongs to another model fingerprint")
    payload = bytearray(view[HEADER_SIZE : HEADER_SIZE + header.payload_len])
    kvbin.verify_payload(header, payload)
    if header.sealed:
        if keys is None:
            raise MasterKeyRequired("this chunk is sealed; a data key lookup is needed")
        open_payload(keys(header), header, memoryview(payload))
    return header, bytes(payload)


# ---- session records ----------------------------------------------------------------------


def record_aad(key_id: bytes, tenant: str, session_id: str, fingerprint: bytes) -> bytes:
    t, s = tenant.encode("utf-8"), session_id.encode("utf-8")
    return b"".join(
        (_RECORD_AAD, bytes(key_id), bytes(fingerprint), struct.pack("<II", len(t), len(s)), t, s)
    )


def seal_record(key: DataKey, session_id: str, fingerprint: bytes, data: bytes) -> bytes:
    """A session's token ids sealed: nonce || ciphertext || tag, bound to the record's id."""
    nonce = os.urandom(NONCE_SIZE)
    aad = record_aad(key.key_id, key.tenant, session_id, fingerprint)
    return nonce + _aesgcm(key.secret).encrypt(nonce, data, aad)


def open_record(key: DataKey, session_id: str, fingerprint: bytes, sealed: bytes) -> bytes:
    aad = record_aad(key.key_id, key.tenant, session_id, fingerprint)
    try:
        return _aesgcm(key.secret).decrypt(sealed[:NONCE_SIZE], sealed[NONCE_SIZE:], aad)
    except _crypto()[4]:
        raise AuthenticationFailed(
            f"session record {session_id[:64]!r} of tenant {key.tenant!r} failed its AES-GCM "
            "tag: it was altered or moved; it is dropped and the session recomputes"
        ) from None
