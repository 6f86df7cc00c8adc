"""Tests for edged.zones: the polygon checks, and zone membership against OpenCV's geometry."""

from __future__ import annotations

import math

import cv2
import numpy as np
import pytest
from allocations import NumpyAllocations

from edged.settings.inspect import _segments_meet, polygon_problem
from edged.zones import NO_ZONE, ZoneMap

SQUARE = [(0.25, 0.25), (0.75, 0.25), (0.75, 0.75), (0.25, 0.75)]
W, H = 640, 480


@pytest.mark.parametrize(
    ("points", "problem"),
    [
        ([(0.1, 0.1), (0.9, 0.1)], "has 2 point(s); a zone needs at least 3"),
        ([(0.1, 0.1), (1.2, 0.1), (0.5, 0.9)], "point (1.2, 0.1) is outside 0..1"),
        ([(0.1, 0.1), (0.5, 0.5), (0.9, 0.9)], "encloses no area"),
        ([(0.1, 0.1), (0.1, 0.1), (0.9, 0.1), (0.5, 0.9)], "repeats point (0.1, 0.1)"),
        ([(0.1, 0.1), (0.9, 0.9), (0.9, 0.1), (0.1, 0.9)], "is self-intersecting: edge 1 crosses edge 3"),
        ([(0.1, 0.1), (0.9, 0.1), (0.9, 0.9), (0.5, 0.1), (0.1, 0.9)], "is self-intersecting"),
    ],
)
def test_unusable_polygons_say_why(points: list[tuple[float, float]], problem: str) -> None:
    found = polygon_problem(points)
    assert found is not None and problem in found


@pytest.mark.parametrize(
    "points",
    [SQUARE, [(0.0, 0.0), (1.0, 0.0), (1.0, 1.0)], [(0.1, 0.1), (0.9, 0.1), (0.5, 0.5), (0.9, 0.9), (0.1, 0.9)]],
)
def test_usable_polygons_pass_concave_ones_included(points: list[tuple[float, float]]) -> None:
    assert polygon_problem(points) is None


def circle(points: int) -> list[tuple[float, float]]:
    return [
        (0.5 + 0.4 * math.cos(2 * math.pi * i / points), 0.5 + 0.4 * math.sin(2 * math.pi * i / points))
        for i in range(points)
    ]


def test_a_zone_may_have_up_to_a_thousand_points() -> None:
    # Ten thousand points took over a minute to check, past systemd's start timeout.
    assert polygon_problem(circle(1000)) is None
    assert polygon_problem(circle(1001)) == (
        "has 1001 points; a zone may have at most 1000: simplify its outline (a traced contour, e.g. with "
        "OpenCV's approxPolyDP)"
    )


def first_crossing_of_every_pair(points: list[tuple[float, float]]) -> str | None:
    """The self-intersection check by its definition: the first two edges, no neighbours, that meet."""
    n = len(points)
    edges = [(points[i], points[(i + 1) % n]) for i in range(n)]
    for i in range(n):
        for j in range(i + 2, n):
            if not (i == 0 and j == n - 1) and _segments_meet(*edges[i], *edges[j]):
                return f"is self-intersecting: edge {i + 1} crosses edge {j + 1}"
    return None


@pytest.mark.parametrize("seed", range(20))
def test_the_self_intersection_check_finds_the_first_crossing_of_every_pair(seed: int) -> None:
    # Simple stars, stars with two points swapped (crossing edges), random scribbles, and points on a
    # coarse grid (edges meeting end to end, along a line, or at equal x): the same first pair, or none.
    rng = np.random.default_rng(seed)
    n = int(rng.integers(4, 60))
    swapped = star(rng, n)
    i, j = rng.choice(n, 2, replace=False)
    swapped[i], swapped[j] = swapped[j], swapped[i]
    scribble = [(float(x), float(y)) for x, y in rng.uniform(0, 1, (n, 2))]
    grid = [(float(x), float(y)) for x, y in rng.integers(0, 5, (n, 2)) / 4]
    grid = [p for k, p in enumerate(grid) if p != grid[k - 1]]  # no point repeated by the next
    for points in (star(rng, n), swapped, scribble, grid):
        found = polygon_problem(points)
        crossing = found if found is not None and found.startswith("is self-intersecting") else None
        assert crossing == first_crossing_of_every_pair(points), points


def star(rng: np.random.Generator, points: int) -> list[tuple[float, float]]:
    """A random simple polygon: vertices at rising angles around a centre, so edges never cross."""
    angles = np.sort(rng.uniform(0, 2 * np.pi, points))
    radius = rng.uniform(0.05, 0.4, points)
    centre = rng.uniform(0.4, 0.6, 2)
    xy = np.clip(centre + radius[:, None] * np.stack([np.cos(angles), np.sin(angles)], axis=1), 0, 1)
    return [(float(x), float(y)) for x, y in xy]


def random_boxes(rng: np.random.Generator, n: int) -> np.ndarray:
    xy = rng.uniform(0, (W, H), (n, 2))
    wh = rng.uniform(2, 120, (n, 2))
    return np.concatenate([xy, np.minimum(xy + wh, (W, H))], axis=1).astype(np.float32)


@pytest.mark.parametrize("seed", range(5))
def test_centre_rule_agrees_with_opencv(seed: int) -> None:
    rng = np.random.default_rng(seed)
    polygon = star(rng, 9)
    boxes = random_boxes(rng, 60)
    zones = ZoneMap({"a": polygon}, 60, overlap=False)(boxes, W, H)
    contour = (np.array(polygon) * (W, H)).astype(np.float32).reshape(-1, 1, 2)
    checked = 0
    for box, zone in zip(boxes, zones, strict=True):
        centre = ((box[0] + box[2]) / 2, (box[1] + box[3]) / 2)
        distance = cv2.pointPolygonTest(contour, (float(centre[0]), float(centre[1])), True)
        if abs(distance) > 0.01:  # on the boundary either answer is right
            assert (zone == 0) == (distance > 0), (box, polygon)
            checked += 1
    assert checked > 50


@pytest.mark.parametrize("seed", range(5))
def test_overlap_rule_agrees_with_a_rasterised_polygon(seed: int) -> None:
    rng = np.random.default_rng(seed)
    polygon = star(rng, 7)
    boxes = random_boxes(rng, 80)
    zones = ZoneMap({"a": polygon}, 80, overlap=True)(boxes, W, H)
    mask = np.zeros((H, W), np.uint8)
    cv2.fillPoly(mask, [np.round(np.array(polygon) * (W, H)).astype(np.int32)], 1)
    decided = {True: 0, False: 0}
    for box, zone in zip(boxes, zones, strict=True):
        x1, y1, x2, y2 = box
        # Rasterising blurs the boundary by a pixel: judge only boxes clearly in or clearly out.
        grown = mask[max(int(y1) - 2, 0) : int(y2) + 3, max(int(x1) - 2, 0) : int(x2) + 3].any()
        shrunk = mask[int(y1) + 2 : max(int(y2) - 1, int(y1) + 2), int(x1) + 2 : max(int(x2) - 1, int(x1) + 2)].any()
        if grown == shrunk:
            assert (zone == 0) == grown, (box, polygon)
            decided[bool(grown)] += 1
    assert decided[True] > 5 and decided[False] > 5


def test_a_box_across_an_edge_overlaps_but_its_centre_is_outside() -> None:
    box = np.array([[0.6 * W, 0.4 * H, 0.95 * W, 0.6 * H]], np.float32)  # centre x 0.775: right of the square
    assert ZoneMap({"a": SQUARE}, 4, overlap=False)(box, W, H).tolist() == [NO_ZONE]
    assert ZoneMap({"a": SQUARE}, 4, overlap=True)(box, W, H).tolist() == [0]


def test_a_box_around_the_whole_zone_overlaps_it() -> None:
    box = np.array([[0.1 * W, 0.1 * H, 0.9 * W, 0.9 * H]], np.float32)
    small = [(0.45, 0.45), (0.55, 0.45), (0.5, 0.55)]
    assert ZoneMap({"a": small}, 4, overlap=True)(box, W, H).tolist() == [0]


def test_the_first_zone_in_order_wins_and_outside_is_no_zone() -> None:
    left = [(0.0, 0.0), (0.6, 0.0), (0.6, 1.0), (0.0, 1.0)]
    right = [(0.4, 0.0), (1.0, 0.0), (1.0, 1.0), (0.4, 1.0)]
    top = [(0.0, 0.0), (1.0, 0.0), (1.0, 0.1)]
    centres = [(0.2, 0.5), (0.5, 0.5), (0.8, 0.5), (0.95, 0.02)]
    boxes = np.array([(x * W - 2, y * H - 2, x * W + 2, y * H + 2) for x, y in centres], np.float32)
    zone_map = ZoneMap({"left": left, "right": right}, 8, overlap=False)
    assert zone_map(boxes, W, H).tolist() == [0, 0, 1, 1]
    assert ZoneMap({"top": top}, 8, overlap=False)(boxes, W, H).tolist() == [NO_ZONE] * 3 + [0]


def test_normalised_zones_survive_a_resolution_change() -> None:
    zone_map = ZoneMap({"a": SQUARE}, 4, overlap=False)
    for w, h in ((640, 480), (1920, 1080), (640, 480)):
        boxes = np.array([[0.4 * w, 0.4 * h, 0.6 * w, 0.6 * h], [0, 0, 0.1 * w, 0.1 * h]], np.float32)
        assert zone_map(boxes, w, h).tolist() == [0, NO_ZONE]


@pytest.mark.parametrize("overlap", [False, True])
def test_membership_creates_no_arrays(overlap: bool) -> None:
    counter = NumpyAllocations.get()
    assert counter is not None
    rng = np.random.default_rng(0)
    zone_map = ZoneMap({"a": star(rng, 12), "b": SQUARE}, 100, overlap=overlap)
    frames = [random_boxes(rng, n) for n in (100, 3, 0, 57)]
    first = [zone_map(boxes, W, H).copy() for boxes in frames]
    with counter.counting():
        before = counter.buffers
        for boxes in frames:
            zone_map(boxes, W, H)
        assert counter.buffers == before
    assert [zone_map(boxes, W, H).tolist() for boxes in frames] == [z.tolist() for z in first]
