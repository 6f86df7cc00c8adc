"""``[inspect]``: what a part must not show, and the zone polygons it is judged in (`edged.verdict` judges).

The polygon checks live here, beside the keys they validate, so that a configuration is checked
without loading the runtime.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Annotated, Literal

from pydantic import Field, field_validator

from edged.settings.section import Name, Section

Point = tuple[float, float]


ZoneName = Name


# The most points a zone may have. A zone drawn by hand, or traced around a part and simplified,
# needs tens of points, rarely hundreds; the self-intersection check may have to compare every pair
# of edges (a zigzag whose edges all span the frame), so without a cap its time grows with the square
# of the points: ten thousand took over a minute, past systemd's start timeout (a restart loop).
MAX_ZONE_POINTS = 1000
MIN_ZONE_AREA = 1e-6  # of the frame: below this a polygon is a line or a point, not a region
MIN_MM_PER_PX, MAX_MM_PER_PX = 1e-6, 1e4  # a nanometre to ten metres per pixel: beyond, a typo (and mm limits overflow)


def usable_zones(zones: Mapping[str, Sequence[Point]]) -> None:
    """Raise ValueError naming every zone that `polygon_problem` refuses: a zones key's validator."""
    problems = [f"zone {name!r} {problem}" for name, points in zones.items() if (problem := polygon_problem(points))]
    if problems:
        raise ValueError("; ".join(problems))


def polygon_problem(points: Sequence[Point]) -> str | None:
    """Why ``points`` is not a usable zone (too few or too many points, outside 0..1, no area,
    self-intersecting), or None."""
    if len(points) < 3:
        return f"has {len(points)} point(s); a zone needs at least 3"
    if len(points) > MAX_ZONE_POINTS:
        return (
            f"has {len(points)} points; a zone may have at most {MAX_ZONE_POINTS}: "
            "simplify its outline (a traced contour, e.g. with OpenCV's approxPolyDP)"
        )
    for x, y in points:
        if not (0.0 <= x <= 1.0 and 0.0 <= y <= 1.0):
            return f"point ({x}, {y}) is outside 0..1 (coordinates are fractions of the frame's width and height)"
    n = len(points)
    edges = [(points[i], points[(i + 1) % n]) for i in range(n)]
    for i, (a, b) in enumerate(edges):
        if a == b:
            return f"repeats point {a} (points {i + 1} and {(i + 1) % n + 1})"
    if (crossing := _first_crossing(edges)) is not None:
        return f"is self-intersecting: edge {crossing[0] + 1} crosses edge {crossing[1] + 1}"
    area = abs(sum(a[0] * b[1] - b[0] * a[1] for a, b in edges)) / 2
    if area < MIN_ZONE_AREA:
        return "encloses no area (its points lie on one line)"
    return None


def _first_crossing(edges: Sequence[tuple[Point, Point]]) -> tuple[int, int] | None:
    """The first pair (i, j), i < j, of a closed polygon's ``edges`` that meet and are no neighbours.

    Only edges whose x ranges overlap can meet, so the edges are swept in order of their left end and
    each is compared with those starting before its right end: a zone of hundreds of points is
    checked in milliseconds rather than against every other edge."""
    n = len(edges)
    left = [min(a[0], b[0]) for a, b in edges]
    right = [max(a[0], b[0]) for a, b in edges]
    order = sorted(range(n), key=left.__getitem__)
    first: tuple[int, int] | None = None
    for at, e in enumerate(order):
        for k in range(at + 1, n):
            f = order[k]
            if left[f] > right[e]:
                break
            i, j = min(e, f), max(e, f)
            if j - i < 2 or (i == 0 and j == n - 1):
                continue  # neighbours share a point
            if (first is None or (i, j) < first) and _segments_meet(*edges[i], *edges[j]):
                first = (i, j)
    return first


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


Threshold = Annotated[float, Field(gt=0, le=1)]
NonNegative = Annotated[int, Field(ge=0, le=65535)]


class InspectConfig(Section):
    """``[inspect]``: what a part must not show. Labels are checked against the model's when it loads."""

    class_conf: dict[str, Threshold] = Field(
        default_factory=dict, description="Label (or class id) -> minimum score, overriding model.conf for that class."
    )
    zones: dict[ZoneName, list[tuple[float, float]]] = Field(
        default_factory=dict,
        description="Name -> polygon [[x, y], ...] in fractions of the frame (0..1); none: the whole frame.",
    )
    outside_zones: Literal["drop", "keep"] = Field(
        "drop",
        description="Detections outside every zone: 'drop' them, or 'keep' them with no zone (never NG). An anomaly "
        "model's regions outside every zone are always kept with no zone and never count, as its map shows them.",
    )
    match: Literal["centre", "overlap"] = Field(
        "centre", description="A detection is in a zone when its box centre is inside, or with 'overlap' any of its box."
    )
    ng_classes: list[str] | None = Field(
        None, description="Labels (or class ids) that make a part NG; default: every class."
    )
    min_area: dict[str, Annotated[float, Field(ge=0, le=1)]] = Field(
        default_factory=dict,
        description="Label (or class id) -> smallest box, as a fraction of the frame's area, that makes a part NG.",
    )

    mm_per_px: float | None = Field(
        None,
        ge=MIN_MM_PER_PX,
        le=MAX_MM_PER_PX,
        description="Segmentation and anomaly models: millimetres per frame pixel of this camera; its messages then "
        "carry area_mm2, length_mm and width_mm (of detections or regions), and the max_*_mm limits apply.",
    )
    max_length_mm: dict[str, Annotated[float, Field(gt=0)]] = Field(
        default_factory=dict,
        description="Segmentation models: label -> the longest defect of the class tolerated, in mm (needs mm_per_px): "
        "within every limit of its class, a defect is reported 'within limits' and does not make the part NG; "
        "anomaly models: the same for their regions, under the class 'anomaly'.",
    )
    max_area_mm2: dict[str, Annotated[float, Field(gt=0)]] = Field(
        default_factory=dict,
        description="Segmentation models: label -> the largest defect (mask area) of the class tolerated, in mm2; "
        "anomaly models: the largest region, under the class 'anomaly'.",
    )
    max_length_px: dict[str, Annotated[float, Field(gt=0)]] = Field(
        default_factory=dict,
        description="As max_length_mm (segmentation models, and anomaly models' regions under the class 'anomaly'), "
        "in frame pixels (no scale needed).",
    )
    max_area_px: dict[str, Annotated[float, Field(gt=0)]] = Field(
        default_factory=dict,
        description="As max_area_mm2 (segmentation models, and anomaly models' regions under the class 'anomaly'), "
        "in frame pixels.",
    )
    min_confidence: float | None = Field(
        None,
        gt=0,
        le=1,
        description="Classification models: a best score below this gives the verdict 'uncertain' (NG on the reject "
        "line, saved as evidence) rather than ok or ng; default: none.",
    )
    roi: tuple[NonNegative, NonNegative, NonNegative, NonNegative] | None = Field(
        None,
        description="Classification models: the region [x1, y1, x2, y2] of the frame, in pixels, that is classified; "
        "default: the whole frame.",
    )

    @field_validator("roi")
    @classmethod
    def _region(cls, v: tuple[int, int, int, int] | None) -> tuple[int, int, int, int] | None:
        if v is not None and not (v[2] > v[0] and v[3] > v[1]):
            raise ValueError(f"roi {list(v)} is no region: x2 must be above x1 and y2 above y1")
        return v

    @field_validator("ng_classes")
    @classmethod
    def _some_class(cls, v: list[str] | None) -> list[str] | None:
        if v is not None and not v:  # every part would be OK, whatever the model finds
            raise ValueError(
                "is empty, so no class could make a part NG: leave it out for every class to, or name the classes that do"
            )
        return v

    @field_validator("zones")
    @classmethod
    def _usable_polygons(cls, v: dict[str, list[tuple[float, float]]]) -> dict[str, list[tuple[float, float]]]:
        usable_zones(v)
        return v
