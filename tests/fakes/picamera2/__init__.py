"""A fake picamera2 for tests on machines without a Raspberry Pi camera: the API edged uses, behaving as picamera2 does.

It mirrors picamera2 0.3.36 (raspberrypi/picamera2 at 3e6dff0, ``picamera2/picamera2.py`` and
``picamera2/request.py``) in what edged relies on:

- ``Picamera2(camera_num)`` indexes ``global_camera_info()`` (an ``IndexError`` for a camera that
  is not there) and raises ``RuntimeError("Camera __init__ sequence did not complete.")`` when
  the camera cannot be acquired; ``camera_controls`` maps names to ``(min, max, default)``.
- ``create_video_configuration`` fills in the video defaults (``XBGR8888`` 1280x720, 6 buffers,
  ``FrameDurationLimits`` 33333 us) under what the caller passes; ``configure`` adds each stream's
  ``stride``, padded to 64 bytes as the ISP does, and keeps one completed request queued when
  ``queue`` and ``buffer_count > 1`` (``_max_queue_len``).
- ``capture_request(wait, flush)`` hands out the newest completed request (older ones go back to
  the camera), else waits for the next; ``wait`` in seconds raises ``concurrent.futures.TimeoutError``;
  ``flush`` (``True`` = now, or a ``time.monotonic_ns`` value) drops requests whose
  ``SensorTimestamp - 1000 * ExposureTime`` is before it. ``captured_request`` releases on exit.
- ``CompletedRequest.get_metadata()`` has ``SensorTimestamp`` (CLOCK_MONOTONIC ns), ``ExposureTime``
  (us) and ``FrameDuration`` (us); releasing a request twice raises ``RuntimeError``.
- ``MappedArray(request, "main")`` is a view onto the buffer: ``(h, w, 3)`` sliced out of
  ``(h, stride)`` rows, so strided when the stride is padded. ``RGB888`` is B, G, R in memory and
  ``BGR888`` is R, G, B (DRM fourccs are little-endian).

What the tests script lives on `Sensor` (in `SENSORS`): its colour, a failing start, being unplugged,
and a request left queued from before a pause. Every pixel of a frame is the sensor's colour, except
the first, whose bytes are all the frame's index (mod 256).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from concurrent.futures import TimeoutError
from typing import Any

import numpy as np
from libcamera import Transform

RGB_FORMATS = ("BGR888", "RGB888", "XBGR8888", "XRGB8888")
STRIDE_ALIGN = 64


class Sensor:
    """One fake camera: what the tests set, and what they read back."""

    def __init__(
        self,
        model: str = "imx708",
        colour: tuple[int, int, int] = (200, 120, 40),
        controls: dict[str, tuple[Any, Any, Any]] | None = None,
        latency_s: float = 0.0,
        exposure_us: int = 1000,
    ) -> None:
        self.model = model
        self.colour = colour  # R, G, B of the scene
        self.controls = controls or {
            "AeEnable": (False, True, True),
            "AfMode": (0, 2, 0),
            "AnalogueGain": (1.0, 16.0, None),
            "ExposureTime": (1, 66666, None),
            "FrameDurationLimits": (33333, 120000, None),
            "NoiseReductionMode": (0, 4, 0),
        }
        self.latency_ns = round(latency_s * 1e9)  # from SensorTimestamp to the request completing
        self.exposure_us = exposure_us
        self.plugged = True
        self.busy = False  # another process holds the camera
        self.fail_start: str | None = None
        self.open_count = 0
        self.outstanding = 0  # requests handed out and not yet released
        self.flushed = 0  # requests dropped by a flush
        self.config: dict[str, Any] = {}
        self.set_controls: dict[str, Any] = {}
        self.handed: list[int] = []  # SensorTimestamp of each request handed out
        self._cond = threading.Condition()
        self._started_ns: int | None = None
        self._period_ns = 33_333_000
        self._next = 0  # index of the first frame not yet handed out
        self._unplugged_ns: int | None = None
        self._queued_ns: int | None = None  # SensorTimestamp of a request left from before a pause

    # ---- what tests do ---------------------------------------------------------------------

    def unplug(self) -> None:
        """The camera goes: no frame completes any more, and libcamera no longer lists it."""
        with self._cond:
            self.plugged = False
            self._unplugged_ns = time.monotonic_ns()
            self._cond.notify_all()

    def plug(self) -> None:
        with self._cond:
            self.plugged = True

    def leave_queued(self, age_s: float) -> None:
        """A completed request exposed ``age_s`` ago waits in picamera2's queue, as after a pause."""
        with self._cond:
            self._queued_ns = time.monotonic_ns() - round(age_s * 1e9)
            self.outstanding += 1

    def index_of(self, stamp_ns: int) -> int:
        assert self._started_ns is not None
        return round((stamp_ns - self._started_ns) / self._period_ns)

    # ---- what the fake Picamera2 does ------------------------------------------------------

    def begin(self, period_us: int) -> None:
        with self._cond:
            self._period_ns = period_us * 1000
            self._started_ns = time.monotonic_ns()
            self._next = 0

    def end(self) -> None:
        with self._cond:
            self._started_ns = None
            if self._queued_ns is not None:
                self._queued_ns = None
                self.outstanding -= 1

    def _stamp(self, index: int) -> int:
        assert self._started_ns is not None
        return self._started_ns + index * self._period_ns

    def _completes_ns(self, index: int) -> int | None:
        done = self._stamp(index) + self.latency_ns
        if self._unplugged_ns is not None and not self.plugged and done > self._unplugged_ns:
            return None
        return done

    def take(self, wait_s: float | None, flush_ns: int | None, keep_queued: bool) -> int:
        """The SensorTimestamp of the request handed out (see the module docstring)."""
        deadline = None if wait_s is None else time.monotonic() + wait_s
        exposure_ns = self.exposure_us * 1000
        with self._cond:
            if self._queued_ns is not None:
                stamp, self._queued_ns = self._queued_ns, None
                if flush_ns is None or stamp - exposure_ns >= flush_ns:
                    self.handed.append(stamp)
                    return stamp
                self.outstanding -= 1
                self.flushed += 1
            if self._started_ns is not None:
                # The newest completed request is the queued one; without a queue only a later one counts.
                newest = (time.monotonic_ns() - self._started_ns - self.latency_ns) // self._period_ns
                self._next = max(self._next, newest if keep_queued else newest + 1)
            while True:
                now = time.monotonic_ns()
                if self._started_ns is not None:
                    newest = (now - self._started_ns - self.latency_ns) // self._period_ns
                    while flush_ns is not None and self._stamp(self._next) - exposure_ns < flush_ns:
                        self.flushed += int(self._next <= newest)
                        self._next += 1
                    done = self._completes_ns(self._next)
                    if done is not None and done <= now:
                        stamp = self._stamp(self._next)
                        self._next += 1
                        self.outstanding += 1
                        self.handed.append(stamp)
                        return stamp
                    until = None if done is None else (done - now) / 1e9
                else:
                    until = None
                if deadline is not None:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise TimeoutError()
                    until = left if until is None else min(until, left)
                self._cond.wait(until)

    def released(self) -> None:
        with self._cond:
            self.outstanding -= 1


SENSORS: list[Sensor] = []


def _plugged() -> list[Sensor]:
    return [s for s in SENSORS if s.plugged]


class CompletedRequest:
    def __init__(self, picam2: Picamera2, stamp_ns: int) -> None:
        self.picam2 = picam2
        self.config = dict(picam2.camera_config)
        self.ref_count = 1
        self._stamp_ns = stamp_ns

    def release(self) -> None:
        self.ref_count -= 1
        if self.ref_count < 0:
            raise RuntimeError("CompletedRequest: lock now has negative ref_count")
        if self.ref_count == 0:
            self.picam2._sensor.released()

    def get_metadata(self) -> dict[str, Any]:
        sensor = self.picam2._sensor
        return {
            "SensorTimestamp": self._stamp_ns,
            "ExposureTime": sensor.exposure_us,
            "FrameDuration": sensor._period_ns // 1000,
        }

    def make_array(self, name: str) -> np.ndarray:
        with MappedArray(self, name) as m:
            return np.copy(m.array)

    def _buffer(self, name: str) -> np.ndarray:
        """The stream's bytes as the ISP writes them: padded rows, channels in the format's memory order."""
        if self.ref_count <= 0:
            raise RuntimeError("failed to find buffer")
        stream = self.config[name]
        width, height = stream["size"]
        r, g, b = self.picam2._sensor.colour
        order = {"RGB888": (b, g, r), "BGR888": (r, g, b), "XBGR8888": (r, g, b, 255), "XRGB8888": (b, g, r, 255)}
        pixel = order[stream["format"]]
        rows = np.zeros((height, stream["stride"]), np.uint8)
        rows[:, : width * len(pixel)] = np.tile(np.array(pixel, np.uint8), width)
        rows[0, : len(pixel)] = self.picam2._sensor.index_of(self._stamp_ns) % 256
        return rows[:, : width * len(pixel)].reshape(height, width, len(pixel))


class MappedArray:
    def __init__(self, request: CompletedRequest, stream: str, reshape: bool = True, write: bool = True) -> None:
        self._request = request
        self._stream = stream
        self._array: np.ndarray | None = None

    def __enter__(self) -> MappedArray:
        self._array = self._request._buffer(self._stream)
        return self

    def __exit__(self, *exc: object) -> None:
        self._array = None

    @property
    def array(self) -> np.ndarray | None:
        return self._array


class Picamera2:
    @staticmethod
    def global_camera_info() -> list[dict[str, Any]]:
        return [
            {"Model": s.model, "Location": 2, "Rotation": 0, "Id": f"/base/axi/i2c@{i}/{s.model}@1a", "Num": i}
            for i, s in enumerate(_plugged())
        ]

    def __init__(self, camera_num: int = 0, verbose_console: int | None = None, tuning: Any = None) -> None:
        self.is_open = False
        self.started = False
        self.camera_config: dict[str, Any] = {}
        self._sensor = _plugged()[camera_num]
        if self._sensor.busy:
            raise RuntimeError("Camera __init__ sequence did not complete.")
        self._sensor.open_count += 1
        self.is_open = True
        self._max_queue_len = 1

    @property
    def camera_controls(self) -> dict[str, tuple[Any, Any, Any]]:
        return dict(self._sensor.controls)

    def create_video_configuration(
        self,
        main: dict[str, Any] | None = None,
        lores: dict[str, Any] | None = None,
        raw: dict[str, Any] | None = None,
        transform: Transform | None = None,
        colour_space: Any = None,
        buffer_count: int = 6,
        controls: dict[str, Any] | None = None,
        display: str | None = "main",
        encode: str | None = "main",
        queue: bool = True,
        sensor: dict[str, Any] | None = None,
        use_case: str = "video",
    ) -> dict[str, Any]:
        if not self.is_open:
            raise RuntimeError("Camera not opened")
        return {
            "use_case": use_case,
            "transform": transform if transform is not None else Transform(),
            "buffer_count": buffer_count,
            "queue": queue,
            "main": {"format": "XBGR8888", "size": (1280, 720), "preserve_ar": True} | (main or {}),
            "lores": lores,
            "controls": {"NoiseReductionMode": 1, "FrameDurationLimits": (33333, 33333)} | (controls or {}),
        }

    def configure(self, camera_config: dict[str, Any]) -> None:
        main = dict(camera_config["main"])
        if main["format"] not in RGB_FORMATS:
            raise RuntimeError(f"Bad format {main['format']} in stream main")
        width, height = main["size"]
        row = width * (3 if main["format"] in ("BGR888", "RGB888") else 4)
        main["stride"] = -(-row // STRIDE_ALIGN) * STRIDE_ALIGN
        main["framesize"] = main["stride"] * height
        self.camera_config = camera_config | {"main": main}
        self._sensor.config = self.camera_config
        self._max_queue_len = 1 if camera_config["queue"] and camera_config["buffer_count"] > 1 else 0

    def camera_configuration(self) -> dict[str, Any]:
        return self.camera_config

    def set_controls(self, controls: dict[str, Any]) -> None:
        for name in controls:
            if name not in self._sensor.controls:
                raise RuntimeError(f"Control {name} is not advertised by libcamera")
        self._sensor.set_controls |= controls

    def start(self, config: Any = None, show_preview: bool | None = False) -> None:
        if not self.camera_config:
            raise RuntimeError("Camera has not been configured")
        if self._sensor.fail_start is not None:
            raise RuntimeError(self._sensor.fail_start)
        limits = self._sensor.set_controls.get("FrameDurationLimits", self.camera_config["controls"]["FrameDurationLimits"])
        self._sensor.begin(limits[0])
        self.started = True

    def stop(self) -> None:
        if self.started:
            self._sensor.end()
            self.started = False

    def close(self) -> None:
        if not self.is_open:
            return
        self.stop()
        self._sensor.open_count -= 1
        self.is_open = False
        self.camera_config = {}

    def capture_request(self, wait: Any = None, signal_function: Any = None, flush: Any = None) -> CompletedRequest:
        if flush is True:
            flush = time.monotonic_ns()
        timeout = None if wait is None or wait is True else float(wait)
        stamp = self._sensor.take(timeout, flush or None, keep_queued=self._max_queue_len > 0)
        return CompletedRequest(self, stamp)

    @contextlib.contextmanager
    def captured_request(self, wait: Any = None, flush: Any = None) -> Iterator[CompletedRequest]:
        request = self.capture_request(wait=wait, flush=flush)
        try:
            yield request
        finally:
            request.release()
