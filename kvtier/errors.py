"""Typed errors. Every message says what went wrong *and* what to do about it."""

from __future__ import annotations


class KvtierError(Exception):
    """Base class of every error kvtier raises on purpose."""


class ConfigError(KvtierError, ValueError):
    """A configuration value is invalid; the message names the setting to change."""


class KeysFileError(ConfigError):
    """The API keys file cannot be used (missing, unreadable, malformed or readable by others)."""


class BudgetError(KvtierError):
    """A tier cannot be built with the requested size (memlock limit, free RAM, free VRAM)."""


class L1BudgetExceeded(KvtierError):
    """An L1 allocation would exceed the configured GPU byte budget even after eviction."""


# ---- L3 / .kvbin ---------------------------------------------------------------------------


class StoreError(KvtierError):
    """Base class of L3 store errors."""


class KvbinFormatError(StoreError):
    """A .kvbin file is malformed (bad magic, truncated, impossible field values)."""


class UnsupportedVersion(KvbinFormatError):
    """A .kvbin file was written by a format version this reader does not know."""


class ChecksumMismatch(KvbinFormatError):
    """A header or payload checksum does not match: the bytes on disk are not what was written."""


class FingerprintMismatch(StoreError):
    """A chunk belongs to another model / dtype / codec and must never be used for this one."""


class StoreFullError(StoreError):
    """The L3 filesystem is full (ENOSPC) or the store's size cap is reached."""


class StoreIOError(StoreError):
    """The device returned an I/O error (EIO) for an L3 read or write."""


class UnsafeRootError(StoreError):
    """The L3 root has unsafe ownership or permissions."""


class ChunkNotFound(StoreError, KeyError):
    """No chunk with that key is stored."""


# ---- sessions / server ------------------------------------------------------------------------


class SessionError(KvtierError):
    """A session operation is not possible in the session's current state."""


class InvalidRequest(KvtierError, ValueError):
    """A client request is malformed; the message tells the client what to send instead."""


class ContextExceeded(InvalidRequest):
    """The prompt alone does not fit in the model's context (or the batch's page pool)."""


# ---- encryption at rest -----------------------------------------------------------------------


class EncryptionError(KvtierError):
    """Base class of encryption-at-rest errors (kvtier.sealing, the L3 keyring)."""


class MasterKeyError(EncryptionError, ConfigError):
    """The master key file is missing, unreadable, not private (0600), malformed, or not the
    key the store was created with. Nothing was read or deleted."""


class MasterKeyRequired(MasterKeyError):
    """The store is encrypted and no master key was given (or a plain store met sealed data)."""


class AuthenticationFailed(ChecksumMismatch):
    """An AES-GCM tag did not verify: the ciphertext, its header or its key was altered. Treated
    like a checksum mismatch (quarantine, then recompute)."""


class TenantKeyShredded(StoreError):
    """The data key that sealed this chunk or record was destroyed (crypto-shred): the bytes
    are unreadable for good. Treat it as a miss; `kvtier l3 gc` removes the files."""


class L4Unavailable(StoreError):
    """The shared tier (Redis) is down, slow or refused the call, or its circuit breaker is
    open. kvtier never passes it to a caller: it serves from L3 or recomputes instead; check
    the Redis server (`redis-cli -u <l4_url> ping`) and its logs."""
