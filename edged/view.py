"""The live view of one camera: its latest processed frame with its boxes drawn, as one JPEG shared by
every viewer of that camera.

The loop offers a frame only when `LiveView.wants_frame` says so: someone is watching, the
encoder is idle and ``view_fps`` allows another. Otherwise it neither copies nor waits. An offered
frame is copied once into a buffer the view keeps (reallocated only when the frame size changes);
the encoder thread scales it to ``view_width``, draws the detections and encodes the JPEG, and
every viewer is woken to send those same bytes. The encoder never queues: while it works, the
loop's frames simply are not offered.

A camera in request mode processes no frame between requests; while someone watches, the loop
offers those frames as previews (no message): shown with the zones and a caption but no boxes, so
that the camera can be aimed and focused, and the page loads, between triggers.

With ``[inspect]`` the encoder also draws the zones (from the configuration, scaled from fractions
of the frame to the shown image, with their names), colours each box in a zone with that zone's
colour, and puts the verdict in a banner across the top: OK green, NG red with its reasons. For an
anomaly model it overlays the anomaly map as a heatmap (blue to red), outlines the regions (with
their peak) and shows the score against its threshold.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import datetime

import cv2
import numpy as np

from edged.messages import DetectionsMessage
from edged.settings.inspect import Point
from edged.sources.base import Frame

# One colour per class (BGR), cycled: saturated enough to read against a grey factory belt.
PALETTE = ((56, 56, 255), (151, 157, 255), (31, 112, 255), (29, 178, 255), (49, 210, 207), (10, 249, 72), (23, 204, 146))
# One colour per zone (BGR), cycled: cyan, magenta, yellow, white, none of them a verdict colour.
ZONE_PALETTE = ((255, 255, 0), (255, 0, 255), (0, 255, 255), (255, 255, 255))
TOP_CLASSES_Y = 32  # a classifier's classes start below the verdict banner
BANNER = {"ok": (40, 160, 40), "ng": (40, 40, 210), "uncertain": (0, 160, 230)}  # BGR: green, red, amber
FONT = cv2.FONT_HERSHEY_SIMPLEX
TALLEST = 4  # a view at most this many times view_width tall (`LiveView._scale`); 4 x 3840 is within a JPEG's 65500

Zones = tuple[tuple[str, np.ndarray], ...]  # (name, (k, 2) points as fractions of the frame)


class LiveView:
    """The annotated latest frame, encoded at most ``fps`` times a second while anyone watches."""

    def __init__(self, camera_id: str, fps: float, width: int, quality: int, zones: Mapping[str, Sequence[Point]]) -> None:
        self._camera_id = camera_id
        self._interval_s = 1.0 / fps
        self._width = width
        self._params = [cv2.IMWRITE_JPEG_QUALITY, quality]
        self._cond = threading.Condition()
        self._viewers = 0
        self._pending = False  # a frame is in the buffer and the encoder has not scaled it yet
        self._due = 0.0  # monotonic time the next frame may be offered
        self._frame: np.ndarray | None = None
        self._order = "bgr"
        self._message: DetectionsMessage | None = None
        self._shown = (0, 0)  # the frame id and wall-clock capture time of the frame in the buffer
        self._scaled: np.ndarray | None = None
        self._heat: np.ndarray | None = None  # the offered frame's heatmap (an anomaly model's map), copied
        self._has_heat = False
        # The heatmap scaled to the view, and coloured: made for the view's size on the first overlay.
        self._heat_scaled = (np.empty((0, 0), np.uint8), np.empty((0, 0, 3), np.uint8))
        self._jpeg = b""
        self._seq = 0
        self._closed = False
        self._zones: Zones = ()
        self.show_zones(zones)
        self._thread = threading.Thread(target=self._encode_loop, name="edged-view", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout=2.0)

    def show_zones(self, zones: Mapping[str, Sequence[Point]]) -> None:
        """The ``[inspect]`` zones to draw from the next frame on (a reload's zones replace the old ones)."""
        self._zones = tuple((name, np.array(points, np.float32)) for name, points in zones.items())

    # ---- the loop's side ---------------------------------------------------------------------

    def wants_frame(self) -> bool:
        """True when a frame offered now would be shown: three reads, no lock, no allocation."""
        return self._viewers > 0 and not self._pending and time.monotonic() >= self._due

    def offer(self, frame: Frame, message: DetectionsMessage | None, heatmap: np.ndarray | None = None) -> None:
        """Copy ``frame`` for the encoder, annotated from ``message`` or, None, a preview, and overlaid
        with ``heatmap`` (`edged.task.TaskResult.heatmap`, stretched over the frame) when given; call
        only right after `wants_frame` said yes."""
        image = frame.image
        if self._frame is None or self._frame.shape != image.shape or self._frame.dtype != image.dtype:
            self._frame = np.empty_like(image)
        np.copyto(self._frame, image)
        if heatmap is not None:
            if self._heat is None or self._heat.shape != heatmap.shape:
                self._heat = np.empty_like(heatmap)
            np.copyto(self._heat, heatmap)
        with self._cond:
            self._has_heat = heatmap is not None
            self._order, self._message, self._pending = frame.channel_order, message, True
            self._shown = (frame.frame_id, frame.t_wall_ns)
            self._due = time.monotonic() + self._interval_s
            self._cond.notify_all()

    # ---- the viewers' side -------------------------------------------------------------------

    @property
    def viewers(self) -> int:
        return self._viewers

    @property
    def closed(self) -> bool:
        """True once closed: its camera left the configuration, or the server stopped."""
        return self._closed

    @property
    def seq(self) -> int:
        """How many JPEGs have been encoded; `next_jpeg` waits for one past a given count."""
        return self._seq

    def start_seq(self) -> int:
        """Where a viewer joining now starts (`next_jpeg`'s ``after``), before it `watch`es: just before the
        latest JPEG while someone else watches, so that it has that frame at once (a slow or triggered
        camera's next one may be seconds away); else at it, to wait for the next, as one encoded before
        nobody watched may show a part long gone."""
        with self._cond:
            return self._seq - 1 if self._viewers > 0 and self._seq > 0 else self._seq

    @contextmanager
    def watch(self) -> Iterator[None]:
        """Count a viewer for as long as the block runs: frames are offered only while one is."""
        with self._cond:
            self._viewers += 1
        try:
            yield
        finally:
            with self._cond:
                self._viewers -= 1

    def next_jpeg(self, after: int, timeout_s: float) -> tuple[int, bytes] | None:
        """The first JPEG encoded after number ``after``, or None on timeout or close."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._seq > after or self._closed, timeout_s) or self._closed:
                return None
            return self._seq, self._jpeg

    # ---- the encoder thread ------------------------------------------------------------------

    def _encode_loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._pending or self._closed)
                if self._closed:
                    return
                frame, order, message, (frame_id, t_wall_ns) = self._frame, self._order, self._message, self._shown
            assert frame is not None  # set by offer
            image = self._scale(frame, order)
            if self._has_heat and self._heat is not None:
                self._overlay(image, self._heat)
            with self._cond:
                self._pending = False  # the buffer is free for the loop's next frame
            if message is None:
                draw_zones(image, self._zones)
                caption(image, self._camera_id, frame_id, t_wall_ns, "  preview: no request")
            else:
                draw(image, message, _shown_scale(image, frame), self._zones)
            ok, encoded = cv2.imencode(".jpg", image, self._params)
            if ok:
                with self._cond:
                    self._jpeg, self._seq = encoded.tobytes(), self._seq + 1
                    self._cond.notify_all()

    def _overlay(self, image: np.ndarray, heat: np.ndarray) -> None:
        """``heat`` (uint8, 255 the most anomalous) stretched over ``image``, coloured (JET: blue to
        red) and blended in at 40 %, in a buffer kept for the view's size."""
        h, w = image.shape[:2]
        grey, colour = self._heat_scaled
        if colour.shape != (h, w, 3):
            grey, colour = self._heat_scaled = np.empty((h, w), np.uint8), np.empty((h, w, 3), np.uint8)
        cv2.resize(heat, (w, h), dst=grey, interpolation=cv2.INTER_LINEAR)
        cv2.applyColorMap(grey, cv2.COLORMAP_JET, dst=colour)
        cv2.addWeighted(image, 0.6, colour, 0.4, 0.0, dst=image)

    def _scale(self, frame: np.ndarray, order: str) -> np.ndarray:
        """``frame`` as BGR at most ``view_width`` wide and `TALLEST` times that tall, in a buffer kept
        for that size. The page shows a frame whole within the window's height, so more rows of a
        tall one (a line-scan strip, 1024x30000: a 15 MB JPEG at the view's width) would cost the
        encoder and the network and show nothing more; a JPEG holds at most 65500 anyway."""
        h, w = frame.shape[:2]
        out_w = min(w, self._width)
        out_h = max(1, round(h * out_w / w))
        if out_h > (tallest := TALLEST * self._width):
            out_w, out_h = max(1, round(w * tallest / h)), tallest
        if self._scaled is None or self._scaled.shape != (out_h, out_w, 3):
            self._scaled = np.empty((out_h, out_w, 3), np.uint8)
        if (out_w, out_h) == (w, h):
            np.copyto(self._scaled, frame)
        else:
            cv2.resize(frame, (out_w, out_h), dst=self._scaled, interpolation=cv2.INTER_AREA)
        if order == "rgb":
            cv2.cvtColor(self._scaled, cv2.COLOR_RGB2BGR, dst=self._scaled)
        return self._scaled


def _shown_scale(shown: np.ndarray, frame: np.ndarray) -> float:
    """How much ``frame`` was scaled to ``shown``, by its longer side: the side rounded least, and
    the one scaled when a frame taller than a JPEG holds keeps its width (`LiveView._scale`)."""
    (shown_h, shown_w), (h, w) = shown.shape[:2], frame.shape[:2]
    return float(shown_h / h if h > w else shown_w / w)


def draw(image: np.ndarray, message: DetectionsMessage, scale: float, zones: Zones) -> None:
    """The zones, then the boxes, labels and scores of ``message`` onto ``image`` (the frame scaled by
    ``scale``; a segmentation model's outlines too; a classifier's best classes, one a line, top left),
    the verdict in a banner across the top, and a caption naming the camera, the frame and its capture
    time, so a frozen view is plain to see."""
    w = image.shape[1]
    colour_of = draw_zones(image, zones)
    for d in message.detections:
        colour = colour_of.get(d.zone or "", PALETTE[d.class_id % len(PALETTE)])
        x1, y1, x2, y2 = (round(v * scale) for v in d.box)
        if d.polygon:  # a segmentation model's instance: its outline, inside a thin box
            outline = np.rint(np.asarray(d.polygon, np.float32) * scale).astype(np.int32)
            cv2.polylines(image, [outline], True, colour, 2, cv2.LINE_AA)
        cv2.rectangle(image, (x1, y1), (x2, y2), colour, 1 if d.polygon else 2)
        text = f"{d.label} {d.score:.2f}" + (f" @{d.zone}" if d.zone else "")
        (_, th), base = cv2.getTextSize(text, FONT, 0.5, 1)
        top = y1 - th - base - 2 if y1 - th - base - 2 >= 0 else y1
        _label(image, text, (x1, top), (255, 255, 255), colour)
    for i, t in enumerate(message.top or ()):
        _label(
            image,
            f"{t.label} {t.score:.2f}",
            (4, TOP_CLASSES_Y + 20 * i),
            (255, 255, 255),
            PALETTE[t.class_id % len(PALETTE)],
        )
    draw_regions(image, message, scale, colour_of)
    if message.verdict is not None:
        reasons = ", ".join(
            f"{r.label}@{r.zone} {r.score:.2f}" if r.zone else f"{r.label} {r.score:.2f}" for r in message.reasons
        )
        text = message.verdict.upper() + (f"  {reasons}" if reasons else "")
        (_, th), base = cv2.getTextSize(text, FONT, 0.6, 2)
        cv2.rectangle(image, (0, 0), (w, th + base + 8), BANNER[message.verdict], cv2.FILLED)
        cv2.putText(image, text, (6, th + 4), FONT, 0.6, (255, 255, 255), 2, cv2.LINE_AA)
    caption(image, message.camera_id, message.frame_id, message.capture_time_ns)


def draw_regions(
    image: np.ndarray, message: DetectionsMessage, scale: float, colour_of: dict[str, tuple[int, int, int]]
) -> None:
    """An anomaly model's regions (their outlines, in their zone's colour) and its score and threshold."""
    if message.anomaly_score is None:
        return
    for region in message.regions or []:
        colour = colour_of.get(region.zone or "", PALETTE[0])
        if len(region.polygon) >= 2:
            outline = np.rint(np.array(region.polygon) * scale).astype(np.int32)
            cv2.polylines(image, [outline], True, colour, 2, cv2.LINE_AA)
        x1, y1 = (round(v * scale) for v in region.box[:2])
        _label(image, f"{region.max_score:.2f}", (x1, max(y1 - 18, 0)), (255, 255, 255), colour)
    text = f"anomaly {message.anomaly_score:.3f} / {message.threshold or 0.5:g}"
    (tw, _), _ = cv2.getTextSize(text, FONT, 0.5, 1)
    _label(
        image, text, (max(image.shape[1] - tw - 10, 0), 30), (255, 255, 255), (0, 0, 160) if message.anomalous else (0, 0, 0)
    )


def draw_zones(image: np.ndarray, zones: Zones) -> dict[str, tuple[int, int, int]]:
    """Each zone's outline and name onto ``image``; returns the colour of each zone by name."""
    h, w = image.shape[:2]
    colour_of: dict[str, tuple[int, int, int]] = {}
    for i, (name, points) in enumerate(zones):
        colour = colour_of[name] = ZONE_PALETTE[i % len(ZONE_PALETTE)]
        corners = np.rint(points * (w - 1, h - 1)).astype(np.int32)
        cv2.polylines(image, [corners], True, colour, 2, cv2.LINE_AA)
        x, y = corners.min(axis=0)
        _label(image, name, (int(x) + 3, int(y) + 3), colour, (0, 0, 0))
    return colour_of


def caption(image: np.ndarray, camera_id: str, frame_id: int, capture_time_ns: int, note: str = "") -> None:
    """The camera, the frame and its capture time across the bottom left, so a frozen view is plain to see."""
    h = image.shape[0]
    when = datetime.fromtimestamp(capture_time_ns / 1e9).strftime("%H:%M:%S.%f")[:-3]
    text = f"{camera_id}  frame {frame_id}  {when}{note}"
    (tw, th), base = cv2.getTextSize(text, FONT, 0.5, 1)
    cv2.rectangle(image, (0, h - th - base - 8), (tw + 10, h), (0, 0, 0), cv2.FILLED)
    cv2.putText(image, text, (5, h - base - 4), FONT, 0.5, (255, 255, 255), 1, cv2.LINE_AA)


def _label(
    image: np.ndarray, text: str, corner: tuple[int, int], ink: tuple[int, int, int], fill: tuple[int, int, int]
) -> None:
    """``text`` in ``ink`` on a ``fill`` rectangle whose top-left is ``corner``."""
    (tw, th), base = cv2.getTextSize(text, FONT, 0.5, 1)
    x, y = corner
    cv2.rectangle(image, (x, y), (x + tw + 4, y + th + base + 2), fill, cv2.FILLED)
    cv2.putText(image, text, (x + 2, y + th + 1), FONT, 0.5, ink, 1, cv2.LINE_AA)
