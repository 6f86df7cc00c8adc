"""Zones: named polygons in normalised frame coordinates, and which of them each detection is in.

Coordinates are fractions of the frame's width and height (0..1), so a zone drawn once survives a
change of camera resolution. `polygon_problem` is the check the configuration runs on every zone
when it loads; `ZoneMap` answers, per frame, which zone each kept detection belongs to. It runs on
the few dozen detections NMS kept, vectorised over (detections x polygon edges) in buffers made
once, so a frame creates no arrays.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

Point = tuple[float, float]

MIN_ZONE_AREA = 1e-6  # of the frame: below this a polygon is a line or a point, not a region
NO_ZONE = -1  # the zone index of a detection outside every zone

_HALF = np.array(0.5, dtype=np.float32)  # 0-d operands: a Python float costs numpy an array per call
_ZERO = np.array(0.0, dtype=np.float32)


def polygon_problem(points: Sequence[Point]) -> str | None:
    """Why ``points`` is not a usable zone (too few points, outside 0..1, no area, self-intersecting), or None."""
    if len(points) < 3:
        return f"has {len(points)} point(s); a zone needs at least 3"
    for x, y in points:
        if not (0.0 <= x <= 1.0 and 0.0 <= y <= 1.0):
            return f"point ({x}, {y}) is outside 0..1 (coordinates are fractions of the frame's width and height)"
    n = len(points)
    edges = [(points[i], points[(i + 1) % n]) for i in range(n)]
    for i, (a, b) in enumerate(edges):
        if a == b:
            return f"repeats point {a} (points {i + 1} and {(i + 1) % n + 1})"
    for i in range(n):
        for j in range(i + 2, n):
            if i == 0 and j == n - 1:
                continue  # neighbours through the closing edge
            if _segments_meet(*edges[i], *edges[j]):
                return f"is self-intersecting: edge {i + 1} crosses edge {j + 1}"
    area = abs(sum(a[0] * b[1] - b[0] * a[1] for a, b in edges)) / 2
    if area < MIN_ZONE_AREA:
        return "encloses no area (its points lie on one line)"
    return None


def _orientation(a: Point, b: Point, c: Point) -> float:
    return (b[0] - a[0]) * (c[1] - a[1]) - (b[1] - a[1]) * (c[0] - a[0])


def _on_segment(a: Point, b: Point, p: Point) -> bool:
    return min(a[0], b[0]) <= p[0] <= max(a[0], b[0]) and min(a[1], b[1]) <= p[1] <= max(a[1], b[1])


def _segments_meet(a: Point, b: Point, c: Point, d: Point) -> bool:
    """Whether segments ab and cd share any point (touching counts)."""
    o1, o2, o3, o4 = _orientation(a, b, c), _orientation(a, b, d), _orientation(c, d, a), _orientation(c, d, b)
    if ((o1 > 0) != (o2 > 0) and o1 != 0 and o2 != 0) and ((o3 > 0) != (o4 > 0) and o3 != 0 and o4 != 0):
        return True
    return any(
        o == 0 and _on_segment(p, q, r) for o, p, q, r in ((o1, a, b, c), (o2, a, b, d), (o3, c, d, a), (o4, c, d, b))
    )


class _Polygon:
    """One zone's edges as (1, P) rows, with what the crossing and side tests need precomputed."""

    def __init__(self, points: Sequence[Point]) -> None:
        start = np.array(points, dtype=np.float32)
        end = np.roll(start, -1, axis=0)
        self.size = start.shape[0]
        self.x0, self.y0 = start[:, 0].reshape(1, -1), start[:, 1].reshape(1, -1)
        dx, dy = (end - start)[:, 0].reshape(1, -1), (end - start)[:, 1].reshape(1, -1)
        self.dx, self.dy = dx, dy
        with np.errstate(divide="ignore", invalid="ignore"):
            self.x_per_y = dx / dy  # inf on horizontal edges, which the crossing test never uses
        self.y1 = end[:, 1].reshape(1, -1)
        self.side0 = self.x0 * dy - self.y0 * dx  # a point p is left of the edge when p.x*dy - p.y*dx < side0
        self.low_x, self.high_x = (
            np.minimum(start[:, 0], end[:, 0]).reshape(1, -1),
            np.maximum(start[:, 0], end[:, 0]).reshape(1, -1),
        )
        self.low_y, self.high_y = (
            np.minimum(start[:, 1], end[:, 1]).reshape(1, -1),
            np.maximum(start[:, 1], end[:, 1]).reshape(1, -1),
        )


class ZoneMap:
    """Which zone each of up to ``capacity`` boxes is in: the first zone in order that holds it.

    With ``overlap`` a box is in a zone when box and polygon share any area; otherwise when the
    box's centre is inside the polygon (even-odd rule). Overlap is decided without clipping:
    a polygon edge that meets the box (bounding boxes overlap, and the box's corners are not all
    on one side of the edge's line) or, failing any, the centre inside the polygon.
    """

    def __init__(self, zones: Mapping[str, Sequence[Point]], capacity: int, *, overlap: bool) -> None:
        self.names = tuple(zones)
        self._polygons = [_Polygon(points) for points in zones.values()]
        self._ids = [np.array(i, dtype=np.intp) for i in range(len(self._polygons))]
        self._overlap = overlap
        edges = max(p.size for p in self._polygons)
        self._scale = np.ones((1, 4), dtype=np.float32)  # 1/w 1/h 1/w 1/h of the last frame size
        self._size: tuple[int, int] | None = None
        self._norm = np.empty((capacity, 4), dtype=np.float32)
        self._centre = np.empty((capacity, 2), dtype=np.float32)
        self._a = np.empty((capacity, edges), dtype=np.float32)
        self._b = np.empty((capacity, edges), dtype=np.float32)
        self._low = np.empty((capacity, edges), dtype=np.float32)
        self._high = np.empty((capacity, edges), dtype=np.float32)
        self._crosses = np.empty((capacity, edges), dtype=np.bool_)
        self._test = np.empty((capacity, edges), dtype=np.bool_)
        self._inside = np.empty(capacity, dtype=np.bool_)
        self._touch = np.empty(capacity, dtype=np.bool_)
        self._zone = np.empty(capacity, dtype=np.intp)

    def __call__(self, xyxy: np.ndarray, frame_w: int, frame_h: int) -> np.ndarray:
        """(m,) zone index of each of the (m, 4) boxes in frame pixels, `NO_ZONE` for none.

        The result is a view of this map's buffer, valid until the next call.
        """
        m = xyxy.shape[0]
        if self._size != (frame_w, frame_h):
            self._scale[0] = (1 / frame_w, 1 / frame_h) * 2
            self._size = (frame_w, frame_h)
        norm, centre, zone = self._norm[:m], self._centre[:m], self._zone[:m]
        np.multiply(xyxy, self._scale, out=norm)
        np.add(norm[:, :2], norm[:, 2:], out=centre)
        np.multiply(centre, _HALF, out=centre)
        zone.fill(NO_ZONE)
        with np.errstate(invalid="ignore", over="ignore"):
            for polygon, zone_id in zip(reversed(self._polygons), reversed(self._ids), strict=True):
                inside = self._holds(polygon, m)
                np.copyto(zone, zone_id, where=inside)
        return zone

    def _holds(self, polygon: _Polygon, m: int) -> np.ndarray:
        """(m,) whether each box is in ``polygon`` by this map's rule."""
        p = polygon.size
        a, crosses, test = self._a[:m, :p], self._crosses[:m, :p], self._test[:m, :p]
        px, py = self._centre[:m, 0:1], self._centre[:m, 1:2]
        inside = self._inside[:m]
        # Even-odd rule: count the edges a ray from the centre towards +x crosses.
        np.greater(polygon.y0, py, out=crosses)
        np.greater(polygon.y1, py, out=test)
        np.not_equal(crosses, test, out=crosses)
        np.subtract(py, polygon.y0, out=a)
        np.multiply(a, polygon.x_per_y, out=a)
        np.add(a, polygon.x0, out=a)
        np.less(px, a, out=test)
        np.logical_and(crosses, test, out=crosses)
        np.logical_xor.reduce(crosses, axis=1, out=inside)
        if self._overlap:
            np.logical_or(inside, self._edge_meets_box(polygon, m), out=inside)
        return inside

    def _edge_meets_box(self, polygon: _Polygon, m: int) -> np.ndarray:
        """(m,) whether any edge of ``polygon`` meets each box (separating axes: x, y, the edge's normal)."""
        p = polygon.size
        a, b, low, high = self._a[:m, :p], self._b[:m, :p], self._low[:m, :p], self._high[:m, :p]
        meets, test = self._crosses[:m, :p], self._test[:m, :p]
        norm = self._norm[:m]
        x1, y1, x2, y2 = norm[:, 0:1], norm[:, 1:2], norm[:, 2:3], norm[:, 3:4]
        np.less_equal(polygon.low_x, x2, out=meets)
        np.greater_equal(polygon.high_x, x1, out=test)
        np.logical_and(meets, test, out=meets)
        np.less_equal(polygon.low_y, y2, out=test)
        np.logical_and(meets, test, out=meets)
        np.greater_equal(polygon.high_y, y1, out=test)
        np.logical_and(meets, test, out=meets)
        # Each corner's side of the edge's line, less side0: all four of one sign means no contact.
        for i, (cx, cy) in enumerate(((x1, y1), (x2, y1), (x1, y2), (x2, y2))):
            np.multiply(cx, polygon.dy, out=a)
            np.multiply(cy, polygon.dx, out=b)
            np.subtract(a, b, out=a)
            np.subtract(a, polygon.side0, out=a)
            if i == 0:
                np.copyto(low, a)
                np.copyto(high, a)
            else:
                np.minimum(low, a, out=low)
                np.maximum(high, a, out=high)
        np.less_equal(low, _ZERO, out=test)
        np.logical_and(meets, test, out=meets)
        np.greater_equal(high, _ZERO, out=test)
        np.logical_and(meets, test, out=meets)
        touch = self._touch[:m]
        np.logical_or.reduce(meets, axis=1, out=touch)
        return touch
