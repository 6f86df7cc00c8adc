"""Memory figures for `edged bench`: numpy buffers allocated per frame, heap growth, soak.

Counting the numpy arrays a frame creates needs every allocation, not the survivors: an
array made and freed inside the frame leaves no trace in a tracemalloc snapshot or in a count of
live objects. numpy (NEP 49, numpy >= 1.22) lets a program install its own data allocator, so
`NumpyAllocations` installs one that counts each new data buffer and hands the request to the C
library. Every ndarray that owns memory allocates exactly one buffer, so the count is the number
of arrays created. Views (a header over another array's buffer) allocate none and are not
counted; they are ordinary Python objects and appear in the tracemalloc figures instead.

`soak` runs the full path for many frames and reports the resident set size and tracemalloc's
traced memory over time; a leak shows as a steady slope in both.
"""

from __future__ import annotations

import ctypes
import importlib
import os
import time
import tracemalloc
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

from edged.bench.rows import STAGES, FullPath
from edged.model import LoadedModel
from edged.scenes import SceneGenerator

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
            b"edged_bench_counter",
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
        return self._libc_malloc(size)

    def _calloc(self, ctx: int | None, n: int, size: int) -> int | None:
        self.buffers += 1
        self.bytes += n * size
        return self._libc_calloc(n, size)

    def _realloc(self, ctx: int | None, ptr: int | None, size: int) -> int | None:
        self.buffers += 1
        self.bytes += size
        return self._libc_realloc(ptr, size)

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
    return handler.version == 1 and handler.name.decode() == _handler_name()


def _handler_name() -> str:
    try:
        multiarray = importlib.import_module("numpy._core.multiarray")
    except ImportError:  # numpy 1.x
        multiarray = importlib.import_module("numpy.core.multiarray")
    return str(multiarray.get_handler_name())


@dataclass(frozen=True, slots=True)
class Allocations:
    """Per frame of the full path in steady state.

    ``numpy_buffers``: arrays created per frame by stage (None where the hook is unavailable);
    ``heap_blocks``/``heap_bytes``: net tracemalloc growth per frame (what stays behind);
    ``transient_peak_bytes``: median of tracemalloc's per-frame peak above the frame's start.
    """

    frames: int
    numpy_buffers: dict[str, float] | None
    numpy_bytes: dict[str, float] | None
    heap_blocks: float
    heap_bytes: float
    transient_peak_bytes: float


def measure_allocations(full: FullPath, frames: int, warmup: int = 20) -> Allocations:
    for _ in range(warmup):
        full()
    counts, sizes = _count_numpy(full, frames)
    tracemalloc.start(1)
    try:
        for _ in range(5):
            full()
        start = tracemalloc.take_snapshot()
        peaks = np.empty(frames)
        for i in range(frames):
            base = tracemalloc.get_traced_memory()[0]
            tracemalloc.reset_peak()
            full()
            peaks[i] = tracemalloc.get_traced_memory()[1] - base
        growth = tracemalloc.take_snapshot().compare_to(start, "filename")
    finally:
        tracemalloc.stop()
    return Allocations(
        frames=frames,
        numpy_buffers=counts,
        numpy_bytes=sizes,
        heap_blocks=sum(s.count_diff for s in growth) / frames,
        heap_bytes=sum(s.size_diff for s in growth) / frames,
        transient_peak_bytes=float(np.median(peaks)),
    )


def _count_numpy(full: FullPath, frames: int) -> tuple[dict[str, float] | None, dict[str, float] | None]:
    """numpy buffers per frame and stage, from the stages called one by one, as `process` does."""
    counter = NumpyAllocations.get()
    if counter is None:
        return None, None
    pipeline, engine = full.pipeline, full.pipeline.model.engine
    steps: dict[str, Callable[[], object]] = {
        "preprocess": lambda: pipeline.preprocess(full.image),
        "inference": engine.run,
        "decode": lambda: pipeline.decoder.decode(pipeline.outputs[0], pipeline.box_map),
        "frame": full,
    }
    buffers = dict.fromkeys(steps, 0)
    sizes = dict.fromkeys(steps, 0)
    with counter.counting():
        for _ in range(frames):
            for name, step in steps.items():
                b0, s0 = counter.buffers, counter.bytes
                step()
                buffers[name] += counter.buffers - b0
                sizes[name] += counter.bytes - s0
    # "frame" is the whole full path; what it adds beyond the three stages is publishing.
    for table in (buffers, sizes):
        table["publish"] = table["frame"] - table["preprocess"] - table["inference"] - table["decode"]
        table["total"] = table.pop("frame")
    order = [*STAGES, "total"]
    return ({k: buffers[k] / frames for k in order}, {k: sizes[k] / frames for k in order})


def rss_kb() -> float:
    """Current resident set size (not the peak) from /proc/self/statm."""
    with open("/proc/self/statm") as f:
        resident_pages = int(f.read().split()[1])
    return resident_pages * os.sysconf("SC_PAGE_SIZE") / 1024


@dataclass(frozen=True, slots=True)
class SoakResult:
    """RSS and traced memory over a long run; slopes are per 1000 frames after warm-up.

    The late slopes fit only the second half of the samples: allocator pools settle early in a
    run, which is a step, not a leak; a leak keeps the late slope up.
    """

    frames: int
    samples: list[tuple[int, float, float]]  # (frame, RSS KB, traced KB)
    rss_slope_kb_per_1000: float
    rss_late_slope_kb_per_1000: float
    traced_growth_kb: float
    traced_slope_kb_per_1000: float
    traced_late_slope_kb_per_1000: float
    median_ms: float
    p99_ms: float
    top_growth: list[str]


def soak_images(count: int = 8) -> list[np.ndarray]:
    """1280x720 scenes with different defects, so detection counts vary from frame to frame."""
    scenes = SceneGenerator(1280, 720, seed=0)
    return [scenes.render(i).image for i in range(count)]


def soak(
    model: LoadedModel,
    frames: int,
    *,
    images: list[np.ndarray] | None = None,
    samples: int = 10,
    warmup: int = 100,
    on_sample: Callable[[int, float, float], None] | None = None,
) -> SoakResult:
    """Run the full path for ``frames`` frames cycling through ``images`` (default
    `soak_images`); sample memory. ``on_sample(frame, rss_kb, traced_kb)`` sees each sample.

    RSS and traced memory are sampled ``samples + 1`` times, the first right after warm-up.
    tracemalloc runs for the whole measured part; the soak's own bookkeeping is filtered out,
    so traced memory is what edged, ONNX Runtime's bindings, ZeroMQ's bindings and numpy keep.
    """
    images = images or soak_images()
    full = FullPath(model, images[0])
    every = max(1, frames // samples)
    points: list[tuple[int, float, float]] = []
    times = np.empty(frames)
    try:
        full.wait_for_subscriber()
        for i in range(warmup):
            full.image = images[i % len(images)]
            full()
        tracemalloc.start(1)
        start = _edged_traces()
        for i in range(frames + 1):
            if i % every == 0 or i == frames:
                points.append((i, rss_kb(), _traced_kb(_edged_traces())))
                if on_sample:
                    on_sample(*points[-1])
            if i == frames:
                break
            full.image = images[i % len(images)]
            t0 = time.perf_counter_ns()
            full()
            times[i] = (time.perf_counter_ns() - t0) / 1e6
        growth = _edged_traces().compare_to(start, "lineno")
    finally:
        tracemalloc.stop()
        full.close()
    x, rss, traced = (np.array(column, float) for column in zip(*points, strict=True))
    late = len(points) // 2
    return SoakResult(
        frames=frames,
        samples=points,
        rss_slope_kb_per_1000=_slope(x, rss) * 1000,
        rss_late_slope_kb_per_1000=_slope(x[late:], rss[late:]) * 1000,
        traced_growth_kb=float(traced[-1] - traced[0]),
        traced_slope_kb_per_1000=_slope(x, traced) * 1000,
        traced_late_slope_kb_per_1000=_slope(x[late:], traced[late:]) * 1000,
        median_ms=float(np.median(times)),
        p99_ms=float(np.percentile(times, 99)),
        top_growth=[str(s) for s in growth[:3] if s.size_diff > 0],
    )


def _edged_traces() -> tracemalloc.Snapshot:
    """Traced blocks, less those of this module and of tracemalloc itself."""
    return tracemalloc.take_snapshot().filter_traces(
        [tracemalloc.Filter(False, __file__), tracemalloc.Filter(False, tracemalloc.__file__)]
    )


def _traced_kb(snapshot: tracemalloc.Snapshot) -> float:
    return sum(stat.size for stat in snapshot.statistics("filename")) / 1024


def _slope(x: np.ndarray, y: np.ndarray) -> float:
    return float(np.polyfit(x, y, 1)[0]) if len(x) >= 2 else 0.0
