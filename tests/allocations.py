"""Counting the numpy arrays a piece of code creates, for the tests that assert the hot path creates none.

Counting them needs every allocation, not the survivors: an array made and freed inside a frame
leaves no trace in a tracemalloc snapshot or in a count of live objects. numpy (NEP 49, numpy
>= 1.22) lets a program install its own data allocator, so `NumpyAllocations` installs one that
counts each new data buffer and hands the request to the C library. Every ndarray that owns
memory allocates exactly one buffer, so the count is the number of arrays created. Views (a
header over another array's buffer) allocate none and are not counted.
"""

from __future__ import annotations

import ctypes
import importlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, cast

import numpy as np

_SET_HANDLER, _GET_HANDLER = 304, 305  # fixed slots of numpy's C-API table since 1.22
_MALLOC = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
_CALLOC = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t)
_REALLOC = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
_FREE = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)


class _Allocator(ctypes.Structure):
    _fields_ = [("ctx", ctypes.c_void_p), ("malloc", _MALLOC), ("calloc", _CALLOC), ("realloc", _REALLOC), ("free", _FREE)]


class _Handler(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char * 127), ("version", ctypes.c_uint8), ("allocator", _Allocator)]


class NumpyAllocations:
    """A counting numpy data allocator; one per process, since arrays it made keep using it."""

    _instance: NumpyAllocations | None = None

    def __init__(self) -> None:
        self.buffers = 0
        self.bytes = 0
        libc = ctypes.PyDLL(None)  # PyDLL: the GIL stays held inside numpy's allocation
        self._libc_malloc, self._libc_calloc = libc.malloc, libc.calloc
        self._libc_realloc, self._libc_free = libc.realloc, libc.free
        for fn in (self._libc_malloc, self._libc_calloc, self._libc_realloc):
            fn.restype = ctypes.c_void_p
        self._libc_malloc.argtypes = [ctypes.c_size_t]
        self._libc_calloc.argtypes = [ctypes.c_size_t, ctypes.c_size_t]
        self._libc_realloc.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        self._libc_free.argtypes = [ctypes.c_void_p]
        self._libc_free.restype = None
        # The callbacks and the struct must outlive every array allocated through them.
        self._handler = _Handler(
            b"edged_test_counter",
            1,
            _Allocator(None, _MALLOC(self._malloc), _CALLOC(self._calloc), _REALLOC(self._realloc), _FREE(self._free)),
        )
        self._name = ctypes.create_string_buffer(b"mem_handler")
        new_capsule = _capi("PyCapsule_New", ctypes.py_object, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)
        self._capsule = new_capsule(ctypes.addressof(self._handler), ctypes.addressof(self._name), None)
        self._set, _ = _api_functions()

    @classmethod
    def get(cls) -> NumpyAllocations | None:
        """The process's counter, or None when this numpy does not offer the hook safely."""
        if cls._instance is None:
            try:
                if not _hook_usable():
                    return None
                cls._instance = cls()
            except (AttributeError, OSError, ValueError):
                return None
        return cls._instance

    def _malloc(self, ctx: int | None, size: int) -> int | None:
        self.buffers += 1
        self.bytes += size
        return cast(int | None, self._libc_malloc(size))

    def _calloc(self, ctx: int | None, n: int, size: int) -> int | None:
        self.buffers += 1
        self.bytes += n * size
        return cast(int | None, self._libc_calloc(n, size))

    def _realloc(self, ctx: int | None, ptr: int | None, size: int) -> int | None:
        self.buffers += 1
        self.bytes += size
        return cast(int | None, self._libc_realloc(ptr, size))

    def _free(self, ctx: int | None, ptr: int | None, size: int) -> None:
        self._libc_free(ptr)

    @contextmanager
    def counting(self) -> Iterator[NumpyAllocations]:
        previous = self._set(self._capsule)
        try:
            yield self
        finally:
            self._set(previous)


def _capi(name: str, restype: Any, *argtypes: Any) -> Any:
    """A private prototype of a Python C-API function (leaves ``ctypes.pythonapi`` untouched)."""
    return ctypes.PYFUNCTYPE(restype, *argtypes)((name, ctypes.pythonapi))


def _api_functions() -> tuple[Callable[[object], object], Callable[[], object]]:
    """numpy's ``PyDataMem_SetHandler`` and ``PyDataMem_GetHandler`` from its C-API table."""
    try:
        umath = importlib.import_module("numpy._core._multiarray_umath")
    except ImportError:  # numpy 1.x
        umath = importlib.import_module("numpy.core._multiarray_umath")
    get_pointer = _capi("PyCapsule_GetPointer", ctypes.c_void_p, ctypes.py_object, ctypes.c_char_p)
    table = ctypes.cast(get_pointer(umath._ARRAY_API, None), ctypes.POINTER(ctypes.c_void_p))
    set_handler = ctypes.PYFUNCTYPE(ctypes.py_object, ctypes.py_object)(table[_SET_HANDLER])
    get_handler = ctypes.PYFUNCTYPE(ctypes.py_object)(table[_GET_HANDLER])
    return set_handler, get_handler


def _hook_usable() -> bool:
    """Check the C-API slots really are numpy's handler functions before calling the setter."""
    if tuple(int(p) for p in np.__version__.split(".")[:2]) < (1, 22):
        return False
    _, get_handler = _api_functions()
    current = get_handler()
    if not _capi("PyCapsule_IsValid", ctypes.c_int, ctypes.py_object, ctypes.c_char_p)(current, b"mem_handler"):
        return False
    get_pointer = _capi("PyCapsule_GetPointer", ctypes.c_void_p, ctypes.py_object, ctypes.c_char_p)
    handler = _Handler.from_address(get_pointer(current, b"mem_handler"))
    return bool(handler.version == 1 and handler.name.decode() == _handler_name())


def _handler_name() -> str:
    try:
        multiarray = importlib.import_module("numpy._core.multiarray")
    except ImportError:  # numpy 1.x
        multiarray = importlib.import_module("numpy.core.multiarray")
    return str(multiarray.get_handler_name())
