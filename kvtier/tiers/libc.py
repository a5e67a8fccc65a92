"""The C library calls the tiers make through ctypes (mmap, munmap, mlock, mincore, syscall),
bound once with their argument types."""

from __future__ import annotations

import ctypes
import ctypes.util

libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
libc.mlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
libc.syscall.restype = ctypes.c_long
MAP_FAILED = ctypes.c_void_p(-1).value
