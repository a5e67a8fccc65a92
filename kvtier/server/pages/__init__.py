"""The page manager: see README.md beside this file. Its face is what this module exports."""

from kvtier.server.pages.manager import Admission, CommitPages, Pages
from kvtier.server.pages.pagecopy import append_kv
from kvtier.server.pages.parking import Key, Parked, key_of

__all__ = ["Admission", "CommitPages", "Key", "Pages", "Parked", "append_kv", "key_of"]
