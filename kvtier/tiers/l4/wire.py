"""Pipelined chunk GETs read off the socket straight into their destination.

redis-py's parser reads a bulk reply in 64 KiB pieces into a growing buffer and copies it out
again: a 14 MB GET costs the client about three times what the bytes cost the wire. Chunks are
the one large value kvtier reads, so their GETs go through here: redis-py opens the connection
(address, TLS, AUTH, SELECT, protocol), then this module writes the GET commands and reads each
reply's header into a small buffer and its payload with `recv_into` right where the sink wants
it (an L2 slot), checksumming it piece by piece as it lands. The value is verified before the
caller hears of it; until then the destination holds bytes nobody uses (like an L3 read's).
The header is checked against the chunk the caller expects (`expects`: tokens, geometry, codec,
payload length) before `dest` is even asked: a value of another shape never lands anywhere.
A sealed value (encrypted store) is decrypted in place piece by piece as it lands, after its
checksum saw the ciphertext, and its AES-GCM tag is verified before the caller hears of it.

Only the replies of GET are read: a bulk string (`$<n>`), a nil (`$-1` in RESP2, `_` in RESP3)
or an error (`-...`). Anything else, or any failure, disconnects the connection.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Sequence
from typing import Any

from kvtier import kvbin
from kvtier.errors import EncryptionError, KvbinFormatError, MasterKeyRequired, StoreError
from kvtier.kvbin import HEADER_SIZE, ChunkHeader
from kvtier.sealing import PayloadOpener
from kvtier.tiers.l4.codec import check_header

PIECE = 1 << 20  # bytes received (and checksummed) per recv_into

Dest = Callable[[int, ChunkHeader], memoryview]
"""(index, decoded header) -> where the payload goes (at least payload_len bytes)."""

Opener = Callable[[ChunkHeader], PayloadOpener]
"""decoded header -> the decryptor of its sealed payload (encrypted stores)."""


class Reply:
    """One GET's outcome: a verified header, None (nil) or an error to raise for that key."""

    __slots__ = ("error", "header", "size")

    def __init__(self) -> None:
        self.header: ChunkHeader | None = None
        self.error: BaseException | None = None
        self.size = 0


class _Reader:
    """Buffered line reads and unbuffered payload reads on one socket."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = bytearray()

    def _fill(self) -> None:
        data = self.sock.recv(65536)
        if not data:
            raise ConnectionError("Redis closed the connection mid-reply")
        self.buf += data

    def line(self) -> bytes:
        while True:
            i = self.buf.find(b"\r\n")
            if i >= 0:
                out = bytes(self.buf[:i])
                del self.buf[: i + 2]
                return out
            self._fill()

    def into(self, view: memoryview, crc: Callable[[memoryview], None] | None = None) -> None:
        """Fill `view` exactly: first from what is buffered, then straight from the socket."""
        pos = min(len(self.buf), len(view))
        if pos:
            view[:pos] = self.buf[:pos]
            del self.buf[:pos]
            if crc is not None:
                crc(view[:pos])
        while pos < len(view):
            n = self.sock.recv_into(view[pos : pos + PIECE])
            if n == 0:
                raise ConnectionError("Redis closed the connection mid-reply")
            if crc is not None:
                crc(view[pos : pos + n])
            pos += n

    def skip(self, n: int) -> None:
        scratch = memoryview(bytearray(min(n, PIECE)))
        while n:
            k = min(n, len(scratch))
            self.into(scratch[:k])
            n -= k


def get_many(
    conn: Any,
    names: Sequence[str],
    chunk_keys: Sequence[bytes],
    fingerprint: bytes,
    tenants: Any,
    dest: Dest,
    response_error: type[Exception],
    opener: Opener | None = None,
    expects: Sequence[ChunkHeader | None] | None = None,
    asking: bool = False,
) -> list[Reply]:
    """Pipeline a GET of every name on redis-py connection `conn` and read the replies.

    `asking`: each GET follows an ASK redirection (a cluster slot being migrated to this node),
    so an ASKING goes before it and its +OK is read first.
    `opener`: the store is encrypted; every value must be sealed and is opened in place.
    `expects`: per key, the header of the chunk the caller asked for (`kvbin.check_expected`);
    a value whose header describes anything else is an error for that key."""
    if conn.can_read():  # something is left unread: this connection is not ours to drive
        conn.disconnect()
        conn.connect()
    # redis-py's own socket, opened, authenticated and on the right database (it has no public
    # getter): the replies are read from it straight into the slots
    sock = conn._sock  # noqa: SLF001
    ask = b"*1\r\n$6\r\nASKING\r\n" if asking else b""
    out = b"".join(ask + b"*2\r\n$3\r\nGET\r\n$%d\r\n%s\r\n" % (len(n), n.encode()) for n in names)
    sock.sendall(out)
    reader = _Reader(sock)
    replies = []
    for i, key in enumerate(chunk_keys):
        rep = Reply()
        replies.append(rep)
        if asking and (ok := reader.line()) != b"+OK":
            raise ConnectionError(f"unexpected reply to ASKING: {ok[:40]!r}")
        head = reader.line()
        if head in (b"$-1", b"_"):
            continue
        if head.startswith(b"-"):
            rep.error = response_error(head[1:].decode("utf-8", "replace"))
            continue
        if not head.startswith(b"$"):
            raise ConnectionError(f"unexpected reply to GET: {head[:40]!r}")
        size = int(head[1:])
        rep.size = size
        expect = None if expects is None else expects[i]
        try:
            rep.header = _value(reader, size, i, key, fingerprint, tenants, dest, opener, expect)
        except (StoreError, EncryptionError) as exc:  # this value's: the stream stays in step
            rep.error = exc
        reader.line()  # the CRLF after the bulk
    if reader.buf:
        raise ConnectionError("Redis sent more than the replies asked for")
    return replies


def _value(
    reader: _Reader,
    size: int,
    i: int,
    key: bytes,
    fingerprint: bytes,
    tenants: Any,
    dest: Dest,
    opener: Opener | None = None,
    expect: ChunkHeader | None = None,
) -> ChunkHeader:
    """Read one bulk value of `size` bytes: header, checks (with `expect`, that it is that
    chunk), payload into `dest` with its CRC (and, sealed, decrypted in place behind the CRC;
    the tag is checked last). Exactly `payload_len` bytes of `dest` are written, and with
    `expect` that is the expected chunk's whole payload.

    A bad value is consumed whole (the connection stays in step) before its error is raised."""
    if size < HEADER_SIZE:
        reader.skip(size)
        raise KvbinFormatError(f"L4 value of chunk {key.hex()} is {size} bytes: truncated")
    hdr = memoryview(bytearray(HEADER_SIZE))
    reader.into(hdr)
    try:
        header = _check(hdr, key, size, fingerprint, tenants, expect)
        if opener is not None:
            op: PayloadOpener | None = opener(header)
        elif header.sealed:
            raise MasterKeyRequired(
                f"L4 chunk {key.hex()} is sealed but this host's store is not encrypted; "
                "start it with --encrypt and the deployment's --master-key-file"
            )
        else:
            op = None
        view = dest(i, header)
        if len(view) < header.payload_len:
            raise KvbinFormatError(f"L4 chunk {key.hex()} does not fit its destination")
        view = view[: header.payload_len]
    except BaseException:
        reader.skip(size - HEADER_SIZE)
        raise
    value = [0, 0]  # checksum, bytes opened

    def crc(piece: memoryview) -> None:
        value[0] = kvbin.checksum(header.checksum, piece, value[0])
        if op is not None:  # the piece is view[start:end]: pieces land in order
            start = value[1]
            value[1] = start + len(piece)
            op.update(view, start, value[1])

    reader.into(view, crc)
    kvbin.verify_crc(header, value[0])
    if op is not None:
        op.finish()  # AuthenticationFailed: nothing of `view` is used
    return header


def _check(
    hdr: memoryview,
    key: bytes,
    size: int,
    fingerprint: bytes,
    tenants: Any,
    expect: ChunkHeader | None = None,
) -> ChunkHeader:
    # the checks of kvtier.tiers.l4.codec.unpack_chunk, before the payload is read
    header = kvbin.decode(hdr)
    return check_header(header, key, size - HEADER_SIZE, fingerprint, tenants, expect)
