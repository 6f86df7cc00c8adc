"""Zones: named polygons in normalised frame coordinates, and which of them each detection is in.

Coordinates are fractions of the frame's width and height (0..1), so a zone drawn once survives a
change of camera resolution. `edged.settings.inspect.polygon_problem` is the check the configuration
runs on every zone
when it loads (``[inspect]``'s zones and a camera's own); `ZoneMap` answers, per frame, which zone
each kept detection belongs to. It runs on the few dozen detections NMS kept, vectorised over
(detections x polygon edges) in buffers made once, so a frame creates no arrays. A segmentation
model's instance is placed by its mask instead (`ZoneRaster`): the zone holding most of its pixels.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import cv2
import numpy as np

from edged.settings.inspect import Point

NO_ZONE = -1  # the zone index of a detection outside every zone

_HALF = np.array(0.5, dtype=np.float32)  # 0-d operands: a Python float costs numpy an array per call


_OUTSIDE = np.array(NO_ZONE, dtype=np.intp)


class ZoneMap:
    """Which zone each of up to ``capacity`` boxes is in: the first zone in order that holds it.

    With ``overlap`` a box is in a zone when box and polygon share any area; otherwise when the
    box's centre is inside the polygon (even-odd rule). Overlap is decided without clipping: a
    polygon edge that meets the box (their bounding boxes overlap, and the box's corners are not
    all on one side of the edge's line) or, failing any, the centre inside the polygon. The edges
    of every zone sit side by side in one row, so each step is one numpy call for all zones,
    reduced per zone at the end.
    """

    def __init__(self, zones: Mapping[str, Sequence[Point]], capacity: int, *, overlap: bool) -> None:
        self.names = tuple(zones)
        polygons = [np.array(points, dtype=np.float32) for points in zones.values()]
        start = np.concatenate(polygons)
        end = np.concatenate([np.roll(p, -1, axis=0) for p in polygons])
        self._first_edge = np.cumsum([0] + [p.shape[0] for p in polygons[:-1]]).astype(np.intp)
        self._overlap = overlap

        def row(values: np.ndarray) -> np.ndarray:
            return np.ascontiguousarray(values, dtype=np.float32).reshape(1, -1)

        self._x0, self._y0, self._y1 = row(start[:, 0]), row(start[:, 1]), row(end[:, 1])
        self._dx, self._dy = row(end[:, 0] - start[:, 0]), row(end[:, 1] - start[:, 1])
        with np.errstate(divide="ignore", invalid="ignore"):
            self._x_per_y = row(self._dx / self._dy)  # inf on horizontal edges, which the crossing test never uses
        self._side0 = row(self._x0 * self._dy - self._y0 * self._dx)  # p.x*dy - p.y*dx against this: p's side
        self._abs_dx, self._abs_dy = np.abs(self._dx), np.abs(self._dy)
        self._low_x, self._high_x = row(np.minimum(start[:, 0], end[:, 0])), row(np.maximum(start[:, 0], end[:, 0]))
        self._low_y, self._high_y = row(np.minimum(start[:, 1], end[:, 1])), row(np.maximum(start[:, 1], end[:, 1]))
        edges, count = start.shape[0], len(polygons)
        self._scale = np.ones((1, 4), dtype=np.float32)  # 1/w 1/h 1/w 1/h of the last frame size
        self._size: tuple[int, int] | None = None
        self._norm = np.empty((capacity, 4), dtype=np.float32)
        self._centre = np.empty((capacity, 2), dtype=np.float32)
        self._a = np.empty((capacity, edges), dtype=np.float32)
        self._b = np.empty((capacity, edges), dtype=np.float32)
        self._extent = np.empty((capacity, edges), dtype=np.float32)
        self._crosses = np.empty((capacity, edges), dtype=np.bool_)
        self._test = np.empty((capacity, edges), dtype=np.bool_)
        self._half = np.empty((capacity, 2), dtype=np.float32)  # half width, half height
        self._inside = np.empty((capacity, count), dtype=np.bool_)
        self._touch = np.empty((capacity, count), dtype=np.bool_)
        self._none = np.empty(capacity, dtype=np.bool_)
        self._zone = np.empty(capacity, dtype=np.intp)

    def __call__(self, xyxy: np.ndarray, frame_w: int, frame_h: int) -> np.ndarray:
        """(m,) zone index of each of the (m, 4) boxes in frame pixels, `NO_ZONE` for none.

        The result is a view of this map's buffer, valid until the next call.
        """
        m = xyxy.shape[0]
        if self._size != (frame_w, frame_h):
            self._scale[0] = (1 / frame_w, 1 / frame_h) * 2
            self._size = (frame_w, frame_h)
        norm, centre, inside, none, zone = self._norm[:m], self._centre[:m], self._inside[:m], self._none[:m], self._zone[:m]
        np.multiply(xyxy, self._scale, out=norm)
        np.add(norm[:, :2], norm[:, 2:], out=centre)
        np.multiply(centre, _HALF, out=centre)
        with np.errstate(invalid="ignore", over="ignore"):
            self._centre_inside(m)
            if self._overlap:
                np.logical_or(inside, self._edge_meets_box(m), out=inside)
        np.argmax(inside, axis=1, out=zone)  # the first zone that holds it
        np.logical_or.reduce(inside, axis=1, out=none)
        np.logical_not(none, out=none)
        np.copyto(zone, _OUTSIDE, where=none)
        return zone

    def _centre_inside(self, m: int) -> None:
        """Fill (m, zones) `_inside`: the even-odd rule, edges a ray from the centre towards +x crosses."""
        a, crosses, test = self._a[:m], self._crosses[:m], self._test[:m]
        px, py = self._centre[:m, 0:1], self._centre[:m, 1:2]
        np.greater(self._y0, py, out=crosses)
        np.greater(self._y1, py, out=test)
        np.not_equal(crosses, test, out=crosses)
        np.subtract(py, self._y0, out=a)
        np.multiply(a, self._x_per_y, out=a)
        np.add(a, self._x0, out=a)
        np.less(px, a, out=test)
        np.logical_and(crosses, test, out=crosses)
        np.logical_xor.reduceat(crosses, self._first_edge, axis=1, out=self._inside[:m])

    def _edge_meets_box(self, m: int) -> np.ndarray:
        """(m, zones) whether any edge of each zone meets each box (separating axes: x, y, the edge's normal)."""
        b, meets, test = self._b[:m], self._crosses[:m], self._test[:m]
        norm = self._norm[:m]
        np.less_equal(self._low_x, norm[:, 2:3], out=meets)
        np.greater_equal(self._high_x, norm[:, 0:1], out=test)
        np.logical_and(meets, test, out=meets)
        np.less_equal(self._low_y, norm[:, 3:4], out=test)
        np.logical_and(meets, test, out=meets)
        np.greater_equal(self._high_y, norm[:, 1:2], out=test)
        np.logical_and(meets, test, out=meets)
        # The box against the edge's line: the centre's distance along the line's normal (dy, -dx)
        # no more than the box's half extent along it, or all four corners are on one side.
        a, extent, half = self._a[:m], self._extent[:m], self._half[:m]
        px, py = self._centre[:m, 0:1], self._centre[:m, 1:2]
        np.subtract(norm[:, 2:], norm[:, :2], out=half)
        np.multiply(half, _HALF, out=half)
        np.multiply(px, self._dy, out=a)
        np.multiply(py, self._dx, out=b)
        np.subtract(a, b, out=a)
        np.subtract(a, self._side0, out=a)
        np.absolute(a, out=a)
        np.multiply(half[:, 0:1], self._abs_dy, out=extent)
        np.multiply(half[:, 1:2], self._abs_dx, out=b)
        np.add(extent, b, out=extent)
        np.less_equal(a, extent, out=test)
        np.logical_and(meets, test, out=meets)
        touch = self._touch[:m]
        np.logical_or.reduceat(meets, self._first_edge, axis=1, out=touch)
        return touch


class ZoneRaster:
    """The zones as frame-size masks, so that a segmentation model's instance is placed by its mask:
    in the zone holding most of its pixels, in none when no zone holds any. Made once per frame size."""

    def __init__(self, zones: Mapping[str, Sequence[Point]]) -> None:
        self._polygons = [np.asarray(points, dtype=np.float64) for points in zones.values()]
        self._size: tuple[int, int] | None = None

    def _plan(self, frame_w: int, frame_h: int) -> None:
        self._rasters = np.zeros((len(self._polygons), frame_h, frame_w), dtype=np.uint8)
        for raster, points in zip(self._rasters, self._polygons, strict=True):
            corners = np.rint(points * (frame_w, frame_h) * 16).astype(np.int32)  # 4 bits of subpixel
            cv2.fillPoly(raster, [corners], 1, cv2.LINE_8, 4)
        self._rasters = self._rasters.view(np.bool_)
        self._scratch = np.empty((frame_h, frame_w), dtype=np.bool_)
        self._size = (frame_w, frame_h)

    def __call__(self, masks: np.ndarray, zones: np.ndarray, frame_w: int, frame_h: int) -> None:
        """Set ``zones[i]`` of each of ``masks`` (m, h, w) to the zone holding most of its pixels (the
        first of equals), `NO_ZONE` where none holds any."""
        if self._size != (frame_w, frame_h):
            self._plan(frame_w, frame_h)
        for i, mask in enumerate(masks):
            best, most = NO_ZONE, 0
            for z, raster in enumerate(self._rasters):
                np.logical_and(mask, raster, out=self._scratch)
                inside = int(np.count_nonzero(self._scratch))
                if inside > most:
                    best, most = z, inside
            zones[i] = best
