"""Any GStreamer pipeline, read through PyGObject: a Jetson CSI camera (``nvarguscamerasrc``), a hardware decoder, ...

The pip OpenCV wheel has no GStreamer backend, so edged drives GStreamer itself. The pipeline ends in
an ``appsink`` that keeps only the newest buffer (``max-buffers=1 drop=true``: latest frame at the
source); the capture thread pulls from it, and only a frame the consumer may take is copied, once,
from the mapped buffer into its slot; frames larger than edged takes (`frame_size_problem`), known
from their caps, never are. Pulling and mapping go through ctypes because PyGObject hands a
mapped buffer over as a ``bytes`` copy; parsing, state changes, caps and the bus go through PyGObject.
GStreamer is imported only when such a source is configured.
"""

from __future__ import annotations

import ctypes
import functools
import importlib
import logging
import os
import re
import time
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from edged.errors import ConfigError, MissingDependency, SourceError
from edged.settings.sources import GstreamerSourceConfig, mask_credentials
from edged.sources.base import frame_size_problem

log = logging.getLogger(__name__)

APPSINK_NAME = "edged"
PULL_SLICE_S = 0.25  # longest single wait in the appsink; the bus is looked at between waits
INSTALL_HINT = (
    "the gstreamer source needs GStreamer and PyGObject: on Debian, Raspberry Pi OS or JetPack install "
    "gir1.2-gstreamer-1.0 gir1.2-gst-plugins-base-1.0 gstreamer1.0-plugins-base gstreamer1.0-plugins-good, "
    "then either make the venv with `python3 -m venv --system-site-packages` next to python3-gi, or build "
    "PyGObject into it (sudo apt install libgirepository1.0-dev libcairo2-dev; pip install 'edged[gstreamer]')"
)
NOT_NEGOTIATED_HINT = (
    "two linked elements agree on no format; check the caps in source.pipeline (the pipeline's own appsink takes "
    'only video/x-raw,format=BGR, RGB with channel_order = "rgb": put `videoconvert !` before it, or leave it '
    "out and edged appends one)"
)
_APPSINK_IN_PIPELINE = re.compile(r"(?:^|!)\s*appsink(?:\s|$)")
_GST_SECOND = 1_000_000_000
_GST_MAP_READ = 1


def config_problems(cfg: GstreamerSourceConfig) -> list[str]:
    """Missing GStreamer, and a pipeline it cannot parse or read, refused when the configuration loads.

    Parsing only builds the elements; no camera is opened. "no element" usually means a plugin
    that is not installed.
    """
    try:
        built = build(cfg.pipeline, cfg.channel_order)
    except MissingDependency as e:
        return [f"source.type: {e}"]
    except ConfigError as e:
        return e.problems
    _gst().stop(built.pipeline)
    return []


def build(pipeline: str, channel_order: Literal["bgr", "rgb"]) -> Built:
    """The pipeline as edged runs it (`full_description`), not yet playing; ``ConfigError`` when it cannot be.

    A pipeline copied from a ``gst-launch-1.0`` command ends in a sink of its own (``autovideosink``,
    ``fakesink``), which the appsink edged appends cannot follow: GStreamer's words for that, "could
    not link fakesink0 to videoconvert0", name neither the sink nor the remedy, so edged's do.
    """
    gst = _gst()
    try:
        return gst.build(full_description(pipeline, channel_order))
    except ConfigError:
        sink = None if _APPSINK_IN_PIPELINE.search(pipeline) else gst.last_sink(pipeline)
        if sink is None:
            raise
        raise ConfigError(
            None,
            [
                f"source.pipeline ends in {sink}, a sink edged cannot take frames from: leave it out (edged then "
                f"ends the pipeline in an appsink of its own) or end it in `appsink name={APPSINK_NAME}`"
            ],
        ) from None


def full_description(pipeline: str, channel_order: Literal["bgr", "rgb"]) -> str:
    """``pipeline`` as given when it has an appsink, else completed with a conversion to ``channel_order`` and one."""
    if _APPSINK_IN_PIPELINE.search(pipeline):
        return pipeline
    return f"{pipeline} ! videoconvert ! video/x-raw,format={channel_order.upper()} ! appsink name={APPSINK_NAME}"


class _MapInfo(ctypes.Structure):
    """``GstMapInfo`` (gst/gstmemory.h), filled by ``gst_buffer_map``."""

    _fields_ = [
        ("memory", ctypes.c_void_p),
        ("flags", ctypes.c_int),
        ("data", ctypes.c_void_p),
        ("size", ctypes.c_size_t),
        ("maxsize", ctypes.c_size_t),
        ("user_data", ctypes.c_void_p * 4),
        ("_gst_reserved", ctypes.c_void_p * 4),
    ]


def _bind(lib: ctypes.CDLL, name: str, restype: Any, *argtypes: Any) -> Any:
    function = getattr(lib, name)
    function.restype = restype
    function.argtypes = list(argtypes)
    return function


@dataclass(frozen=True, slots=True)
class Built:
    """A parsed pipeline (state NULL), its bus, and the appsink edged reads with its C pointer."""

    pipeline: Any
    bus: Any
    sink: Any
    sink_pointer: int


@dataclass(frozen=True, slots=True)
class BusEvent:
    """An error (with GStreamer's message) or the end of the stream, as posted on the pipeline's bus."""

    kind: Literal["error", "eos"]
    text: str


@dataclass(frozen=True, slots=True)
class Geometry:
    """Where the pixels of one negotiated caps lie in a buffer: packed 3-byte RGB or BGR rows."""

    width: int
    height: int
    stride: int
    format: str
    fps: float


class _Gst:
    """The narrow, typed face of GStreamer that edged uses; everything untyped (gi, ctypes) stays inside."""

    def __init__(self) -> None:
        gi = importlib.import_module("gi")
        gi.require_version("Gst", "1.0")
        self._gst: Any = importlib.import_module("gi.repository.Gst")
        self._gst.init(None)
        self._ends = self._gst.MessageType.ERROR | self._gst.MessageType.EOS
        void_p, c_uint64, c_int = ctypes.c_void_p, ctypes.c_uint64, ctypes.c_int
        core, app = ctypes.CDLL("libgstreamer-1.0.so.0"), ctypes.CDLL("libgstapp-1.0.so.0")
        self._pull = _bind(app, "gst_app_sink_try_pull_sample", void_p, void_p, c_uint64)
        self._sample_buffer = _bind(core, "gst_sample_get_buffer", void_p, void_p)
        self._sample_caps = _bind(core, "gst_sample_get_caps", void_p, void_p)
        self._map = _bind(core, "gst_buffer_map", c_int, void_p, ctypes.POINTER(_MapInfo), c_int)
        self._unmap = _bind(core, "gst_buffer_unmap", None, void_p, ctypes.POINTER(_MapInfo))
        self._ref = _bind(core, "gst_mini_object_ref", void_p, void_p)
        self._unref = _bind(core, "gst_mini_object_unref", None, void_p)
        self._caps_to_string = _bind(core, "gst_caps_to_string", void_p, void_p)
        self._free = _bind(ctypes.CDLL("libglib-2.0.so.0"), "g_free", None, void_p)
        capsule = ctypes.pythonapi.PyCapsule_GetPointer
        capsule.restype, capsule.argtypes = void_p, [ctypes.py_object, ctypes.c_char_p]
        self._capsule = capsule

    def build(self, description: str) -> Built:
        """The pipeline built from ``description`` with the appsink edged reads; ``ConfigError`` with GStreamer's words."""
        try:
            pipeline = self._gst.parse_launch(description)
        except Exception as e:  # GLib.GError, the only thing parse_launch raises
            message = mask_credentials(str(getattr(e, "message", e)))
            raise ConfigError(None, [f"source.pipeline: GStreamer cannot parse it: {message}"]) from None
        sink = pipeline.get_by_name(APPSINK_NAME)
        if sink is None:
            found = self._appsinks(pipeline)
            if len(found) != 1:
                raise ConfigError(
                    None, [f"source.pipeline has {len(found)} appsinks: name the one edged reads 'name={APPSINK_NAME}'"]
                )
            sink = found[0]
        elif sink.get_factory().get_name() != "appsink":
            raise ConfigError(None, [f"source.pipeline: the element named '{APPSINK_NAME}' is not an appsink"])
        return Built(pipeline, pipeline.get_bus(), sink, int(self._capsule(sink.__gpointer__, None)))

    def last_sink(self, description: str) -> str | None:
        """The factory name of a sink that ``description`` parsed alone has, or None (it has none, or does not parse)."""
        try:
            parsed = self._gst.parse_launch(description)
        except Exception:  # GLib.GError: the description's own error is GStreamer's to tell
            return None
        if isinstance(parsed, self._gst.Bin):
            sinks = self._all(parsed.iterate_sinks())
        else:  # a description of one element is that element
            sinks = [parsed] if "Sink" in parsed.get_factory().get_metadata("klass") else []
        return str(sinks[0].get_factory().get_name()) if sinks else None

    def _appsinks(self, pipeline: Any) -> list[Any]:
        return self._all(pipeline.iterate_all_by_element_factory_name("appsink"))

    def _all(self, iterator: Any) -> list[Any]:
        found: list[Any] = []
        while True:
            result, element = iterator.next()
            if result != self._gst.IteratorResult.OK:
                return found
            found.append(element)

    def keep_newest(self, sink: Any, channel_order: Literal["bgr", "rgb"]) -> None:
        """Latest-frame semantics at the source, and a pixel format edged can copy when the pipeline left it open."""
        sink.set_property("max-buffers", 1)
        sink.set_property("drop", True)
        if sink.get_property("caps") is None:
            sink.set_property("caps", self._gst.Caps.from_string(f"video/x-raw,format={channel_order.upper()}"))

    def play(self, built: Built, timeout_s: float) -> str | None:
        """Start the pipeline; GStreamer's error when it cannot start."""
        changed = built.pipeline.set_state(self._gst.State.PLAYING)
        if changed != self._gst.StateChangeReturn.FAILURE:
            changed, _, _ = built.pipeline.get_state(round(timeout_s * _GST_SECOND))
        if changed != self._gst.StateChangeReturn.FAILURE:
            return None
        # The element that failed posts its error on the bus, possibly just after the state change returns.
        message = built.bus.timed_pop_filtered(_GST_SECOND, self._gst.MessageType.ERROR)
        return self._error_text(message) if message is not None else "the pipeline failed to start"

    def stop(self, pipeline: Any) -> None:
        pipeline.set_state(self._gst.State.NULL)

    def poll_bus(self, bus: Any) -> BusEvent | None:
        """The first error or end-of-stream waiting on the bus; the messages before it are dropped.

        Without a GLib main loop nothing else empties the bus, so polling it also keeps it from growing.
        """
        message = bus.pop_filtered(self._ends)
        if message is None:
            return None
        if message.type != self._gst.MessageType.ERROR:
            return BusEvent("eos", "end of stream")
        return BusEvent("error", self._error_text(message))

    def _error_text(self, message: Any) -> str:
        """GStreamer's own words for an error message: the element, the error, and the reason when given."""
        error, debug = message.parse_error()
        # The debug text's first line is where in GStreamer's code; what follows, when anything does, is the reason.
        reasons = debug.splitlines()[1:] if debug else []
        detail = f" ({reasons[-1].strip()})" if reasons else ""
        if "not-negotiated" in detail:  # GStreamer says no more; without a hint it reads like a broken camera
            detail += f": {NOT_NEGOTIATED_HINT}"
        return mask_credentials(f"{message.src.get_name()}: {error.message}{detail}")

    def pull(self, sink: int, timeout_s: float) -> int:
        """A sample pointer from the appsink (the caller owns it: `release`), or 0 on timeout, EOS or error."""
        return int(self._pull(sink, round(timeout_s * _GST_SECOND)) or 0)

    def release(self, sample_or_caps: int) -> None:
        self._unref(sample_or_caps)

    def hold_caps(self, sample: int) -> int:
        """The sample's caps pointer with a reference taken, so that the same pointer means the same caps."""
        return int(self._ref(self._sample_caps(sample)))

    def caps_pointer(self, sample: int) -> int:
        return int(self._sample_caps(sample) or 0)

    def geometry(self, caps: int) -> Geometry | str:
        """Where the pixels of a buffer with these caps lie, or why edged cannot read them."""
        text_pointer = self._caps_to_string(caps)
        try:
            text = ctypes.string_at(text_pointer).decode()
        finally:
            self._free(text_pointer)
        structure = self._gst.Caps.from_string(text).get_structure(0)
        pixel_format = structure.get_string("format")
        if structure.get_name() != "video/x-raw" or pixel_format not in ("BGR", "RGB"):
            return f"the appsink receives {text}; edged reads video/x-raw in format BGR or RGB"
        _, width = structure.get_int("width")
        _, height = structure.get_int("height")
        has_rate, num, den = structure.get_fraction("framerate")
        fps = num / den if has_rate and den else 0.0
        # GStreamer's default layout for packed 3-byte formats: rows padded to a multiple of 4 bytes.
        return Geometry(int(width), int(height), (int(width) * 3 + 3) & ~3, str(pixel_format), fps)

    def copy(self, sample: int, geometry: Geometry, out: np.ndarray, info: _MapInfo) -> bool:
        """The sample's pixels copied into ``out`` (C-contiguous, ``geometry``'s shape); False if the buffer is short."""
        buffer = self._sample_buffer(sample)
        if not buffer or not self._map(buffer, ctypes.byref(info), _GST_MAP_READ):
            return False
        try:
            row = geometry.width * 3
            if info.size < geometry.stride * (geometry.height - 1) + row:
                return False
            if geometry.stride == row:
                ctypes.memmove(out.ctypes.data, info.data, row * geometry.height)
            else:
                for y in range(geometry.height):
                    ctypes.memmove(out.ctypes.data + y * row, info.data + y * geometry.stride, row)
            return True
        finally:
            self._unmap(buffer, ctypes.byref(info))


@functools.cache
def _gst() -> _Gst:
    """GStreamer, initialised once per process; ``MissingDependency`` saying what to install when it is not there.

    libgcc_s is made global first. Debian's libgstreamer links libunwind, whose ``_Unwind_*``
    functions have the same names as libgcc_s's, and GObject introspection opens libgstreamer
    RTLD_GLOBAL: every C++ library that binds its unwinder afterwards (ONNX Runtime's Python
    module binds at load, libstdc++ at its first throw) would take libunwind's ``_Unwind_Resume``
    while libstdc++ throws with libgcc_s's ``_Unwind_RaiseException``, and the first exception
    ONNX Runtime throws and catches inside a run aborts the process. With libgcc_s global before
    libunwind, every later lookup finds libgcc_s's; libgstreamer uses only libunwind's own
    ``unw_*`` names, which stay its.
    """
    try:
        ctypes.CDLL("libgcc_s.so.1", mode=os.RTLD_GLOBAL)
        return _Gst()
    except (ImportError, ValueError, OSError) as e:  # no gi, no Gst typelib, no libgstapp
        raise MissingDependency(f"{INSTALL_HINT} ({e})") from None


class GstreamerSource:
    """A GStreamer pipeline ending in an appsink; ``grab`` pulls the newest sample, ``retrieve`` copies it out."""

    def __init__(self, cfg: GstreamerSourceConfig) -> None:
        self._cfg = cfg
        self.channel_order: Literal["bgr", "rgb"] = cfg.channel_order
        self._built: Built | None = None
        self._sample = 0  # the sample last grabbed, owned until the next grab or close
        self._caps = 0  # caps of the current geometry, referenced
        self._geometry: Geometry | None = None
        self._info = _MapInfo()
        self._delivered = False
        self._ended = False  # end of stream seen on the bus; the appsink may still hold its last frame

    def timeouts(self) -> tuple[float, float]:
        return self._cfg.open_timeout_s, self._cfg.read_timeout_s

    def open(self) -> None:
        gst = _gst()
        built = build(self._cfg.pipeline, self.channel_order)
        self._built = built
        gst.keep_newest(built.sink, self.channel_order)
        problem = gst.play(built, self._cfg.open_timeout_s)
        if problem is not None:
            raise SourceError(f"GStreamer pipeline failed to start: {problem}")

    def read(self, out: np.ndarray | None) -> np.ndarray | None:
        return self.retrieve(out) if self.grab() else None

    def grab(self) -> bool:
        """Take the newest sample off the appsink without copying it; False at end of stream.

        Waits in slices of `PULL_SLICE_S` and looks at the bus before each, so a pipeline error is
        reported as soon as GStreamer posts it, the frame queued before an end of stream is still
        delivered, and a silent pipeline is lost after ``open_timeout_s`` (first frame) or
        ``read_timeout_s`` instead of blocking the capture thread.
        """
        gst, built = _gst(), self._opened()
        self._drop_sample()
        limit_s = self._cfg.read_timeout_s if self._delivered else self._cfg.open_timeout_s
        deadline = time.monotonic() + limit_s
        while True:
            event = gst.poll_bus(built.bus)
            if event is not None and event.kind == "error":
                raise SourceError(f"GStreamer pipeline failed: {event.text}")
            self._ended = self._ended or event is not None
            sample = gst.pull(built.sink_pointer, 0.0 if self._ended else PULL_SLICE_S)
            if sample:
                self._sample = sample
                self._delivered = True
                return True
            if self._ended:
                return False
            if time.monotonic() >= deadline:
                raise SourceError(f"the GStreamer pipeline delivered no frame for {limit_s:g} s")

    def retrieve(self, out: np.ndarray | None) -> np.ndarray:
        """The sample last grabbed, copied once into ``out`` when its shape fits (else into a new array)."""
        if not self._sample:
            raise SourceError("GStreamer source retrieved before a frame was grabbed")
        geometry = self._geometry_of(self._sample)
        shape = (geometry.height, geometry.width, 3)
        if out is None or out.shape != shape or out.dtype != np.uint8 or not out.flags.c_contiguous:
            out = np.empty(shape, np.uint8)
        if not _gst().copy(self._sample, geometry, out, self._info):
            raise SourceError(f"a GStreamer buffer is smaller than its caps say ({geometry.width}x{geometry.height})")
        return out

    def _geometry_of(self, sample: int) -> Geometry:
        gst = _gst()
        caps = gst.caps_pointer(sample)
        if self._geometry is not None and caps == self._caps:
            return self._geometry
        geometry = gst.geometry(caps)
        if isinstance(geometry, str):
            raise SourceError(geometry)
        if (problem := frame_size_problem(geometry.width, geometry.height)) is not None:
            raise SourceError(
                f"the GStreamer pipeline delivers frames of {problem} (scale them down in it, e.g. "
                "`! videoscale ! video/x-raw,width=1920,height=1080`)"
            )
        if geometry.format.lower() != self.channel_order:
            raise SourceError(
                f"the pipeline delivers {geometry.format} frames but source.channel_order is {self.channel_order!r}: "
                f"end it in video/x-raw,format={self.channel_order.upper()} or set channel_order"
            )
        self._drop_caps()
        self._caps = gst.hold_caps(sample)
        self._geometry = geometry
        log.info(
            "GStreamer pipeline negotiated %dx%d %s at %.1f fps",
            geometry.width,
            geometry.height,
            geometry.format,
            geometry.fps,
            extra={"CAMERA": self._cfg.camera_id},
        )
        return geometry

    def _opened(self) -> Built:
        if self._built is None:
            raise SourceError("GStreamer source read before open()")
        return self._built

    def _drop_sample(self) -> None:
        if self._sample:
            _gst().release(self._sample)
            self._sample = 0

    def _drop_caps(self) -> None:
        if self._caps:
            _gst().release(self._caps)
            self._caps = 0

    def close(self) -> None:
        self._drop_sample()
        self._drop_caps()
        built, self._built = self._built, None
        if built is not None:
            _gst().stop(built.pipeline)
