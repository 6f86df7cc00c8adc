"""Raspberry Pi cameras (Camera Module 3, HQ, Global Shutter) through libcamera's picamera2.

On Bookworm these cameras are reached through libcamera, not V4L2 through OpenCV. The main stream
is configured in the colour order edged hands on, so the ISP writes the frame as the model wants
it and the only copy left is the one into the capture slot. picamera2 comes from Debian's
``python3-picamera2`` (its libcamera bindings are not on PyPI), so it is imported only when such a
camera is configured.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import importlib
import logging
import time
from collections.abc import Iterator
from types import ModuleType
from typing import Any, Literal

import numpy as np

from edged.errors import ConfigError, MissingDependency, SourceError
from edged.settings.sources import Picamera2SourceConfig

log = logging.getLogger(__name__)


# picamera2 names formats as libcamera/DRM fourccs, which are little-endian: "RGB888" is B, G, R
# in memory and "BGR888" is R, G, B.
MAIN_FORMAT: dict[str, str] = {"bgr": "RGB888", "rgb": "BGR888"}
STALE_FRAMES = 4  # a queued frame exposed this many frame times before the read is from before a pause
STALE_MIN_S = 0.25
READ_TIMEOUT_MIN_S = 2.0  # the first frame after start comes only after the sensor and the ISP settle


def config_problems(cfg: Picamera2SourceConfig) -> list[str]:
    """A missing picamera2 is refused when the configuration loads, not retried as a lost camera."""
    try:
        load_picamera2()
    except MissingDependency as e:
        return [f"source.type: {e}"]
    return []


def load_picamera2() -> ModuleType:
    """The picamera2 module, or `MissingDependency` saying how a board gets it."""
    try:
        return importlib.import_module("picamera2")
    except ImportError as e:
        raise MissingDependency(
            f"a picamera2 camera needs the picamera2 module, which this Python cannot import ({e}): "
            "install Debian's python3-picamera2 (sudo apt install python3-picamera2) and run edged from "
            "a venv made with `python3 -m venv --system-site-packages` with Debian's python3 "
            "(picamera2's libcamera bindings are not on PyPI)"
        ) from e


class Picamera2Source:
    """One camera through ``Picamera2``: configured once per open, read with one copy per frame.

    ``read`` takes a completed request, copies its ``MappedArray`` view of the main stream
    (possibly strided, onto the camera's buffer) into the capture slot and releases the request
    before returning, so no reference to a camera buffer outlives the call. The frame's capture
    time is the request's ``SensorTimestamp`` (CLOCK_MONOTONIC ns), reported as `frame_age_ns`.
    """

    def __init__(self, cfg: Picamera2SourceConfig) -> None:
        self._cfg = cfg
        self.channel_order: Literal["bgr", "rgb"] = cfg.channel_order
        self._camera: Any = None
        self._mapped_array: Any = None
        self._frame_ns = round(1e9 / cfg.fps)
        self._stale_ns = max(STALE_FRAMES * self._frame_ns, round(STALE_MIN_S * 1e9))
        self._wait_s = max(READ_TIMEOUT_MIN_S, 3.0 / cfg.fps)
        self._age_ns = 0
        self._name = f"Raspberry Pi camera {cfg.camera}"

    def open(self) -> None:
        module = load_picamera2()
        self._mapped_array = module.MappedArray
        cameras = module.Picamera2.global_camera_info()
        if self._cfg.camera >= len(cameras):
            found = ", ".join(f"{i}: {c.get('Model', '?')}" for i, c in enumerate(cameras)) or "none"
            raise SourceError(
                f"no {self._name}: libcamera lists {found} (check the ribbon cable and "
                "`rpicam-hello --list-cameras`, then source.camera)"
            )
        try:
            self._camera = module.Picamera2(self._cfg.camera)
        except (RuntimeError, OSError, IndexError) as e:
            raise SourceError(
                f"cannot open {self._name}: {e} (is another process using it? check `fuser /dev/media*`)"
            ) from e
        try:
            self._start(self._camera)
        except BaseException:
            self.close()
            raise

    def _start(self, camera: Any) -> None:
        cfg = self._cfg
        self._check_controls(camera.camera_controls)
        from libcamera import Transform  # installed with picamera2, which imports it itself

        duration_us = round(1e6 / cfg.fps)
        try:
            config = camera.create_video_configuration(
                main={"size": (cfg.width, cfg.height), "format": MAIN_FORMAT[cfg.channel_order]},
                buffer_count=cfg.buffer_count,
                controls={"FrameDurationLimits": (duration_us, duration_us)},
                transform=Transform(hflip=cfg.hflip, vflip=cfg.vflip),
            )
            camera.configure(config)
            if cfg.controls:
                camera.set_controls({k: tuple(v) if isinstance(v, list) else v for k, v in cfg.controls.items()})
            camera.start()
        except (RuntimeError, OSError, ValueError) as e:
            raise SourceError(f"cannot start {self._name}: {e}") from e
        main = camera.camera_configuration()["main"]
        width, height = main["size"]
        log.info(
            "%s negotiated %s %dx%d at %.1f fps, %s order",
            self._name,
            main["format"],
            width,
            height,
            cfg.fps,
            cfg.channel_order,
            extra={"CAMERA": cfg.camera_id},
        )
        if (width, height) != (cfg.width, cfg.height):
            log.warning(
                "%s gives %dx%d instead of the requested %dx%d",
                self._name,
                width,
                height,
                cfg.width,
                cfg.height,
                extra={"CAMERA": cfg.camera_id},
            )

    def _check_controls(self, available: dict[str, Any]) -> None:
        unknown = sorted(set(self._cfg.controls) - set(available))
        if unknown:
            raise ConfigError(
                None,
                [
                    f"source.controls: {self._name} has no control {name}; it has {', '.join(sorted(available))}"
                    for name in unknown
                ],
            )

    def read(self, out: np.ndarray | None) -> np.ndarray:
        """The newest frame, copied into ``out`` when its shape fits.

        picamera2 keeps the newest completed request queued, so after a pause (the reader away, a
        trigger-mode sensor idle) it is from before the pause: such a frame is dropped and one
        exposed after this call waited for (picamera2's ``flush``).
        """
        called_ns = time.monotonic_ns()
        with self._request(flush=None) as request:
            stamp_ns = self._stamp(request)
            if called_ns - stamp_ns <= self._stale_ns:
                return self._copy(request, out, stamp_ns)
        with self._request(flush=called_ns) as request:
            return self._copy(request, out, self._stamp(request))

    def frame_age_ns(self) -> int:
        """How long before the last ``read`` returned its frame's sensor exposure was timestamped."""
        return self._age_ns

    @contextlib.contextmanager
    def _request(self, flush: int | None) -> Iterator[Any]:
        """A completed request, released when the block ends however it ends; camera failures as `SourceError`."""
        if self._camera is None:
            raise SourceError(f"{self._name} read before open()")
        try:
            with self._camera.captured_request(wait=self._wait_s, flush=flush) as request:
                yield request
        except concurrent.futures.TimeoutError as e:
            raise SourceError(
                f"{self._name} delivered no frame for {self._wait_s:.1f} s (camera unplugged or its "
                "ribbon cable loose? check `dmesg`)"
            ) from e
        except (RuntimeError, OSError) as e:
            raise SourceError(f"{self._name} failed: {e}") from e

    def _stamp(self, request: Any) -> int:
        return int(request.get_metadata()["SensorTimestamp"])

    def _copy(self, request: Any, out: np.ndarray | None, stamp_ns: int) -> np.ndarray:
        with self._mapped_array(request, "main", write=False) as mapped:
            view: np.ndarray = mapped.array
            if out is not None and out.shape == view.shape:
                np.copyto(out, view)
                image = out
            else:
                image = np.array(view)
        self._age_ns = time.monotonic_ns() - stamp_ns
        return image

    def close(self) -> None:
        camera, self._camera = self._camera, None
        if camera is not None:
            camera.close()
