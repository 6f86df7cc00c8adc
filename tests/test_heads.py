"""Tests for edged.heads: the registry, and detecting the head format from shapes and metadata."""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from pathlib import Path
from typing import get_args

import pytest
from pydantic import ValidationError

from edged.config import HeadName, ModelConfig
from edged.errors import HeadError
from edged.heads import registry
from edged.heads.anomaly import AnomalyHead
from edged.heads.classify import ClassifyHead
from edged.heads.registry import FORMATS, HEADS, detect_head, format_named, head_named

NAMES_80 = {"names": str({i: f"class{i}" for i in range(80)})}
NAMES_3 = {"names": "{0: 'a', 1: 'b', 2: 'c'}"}
NAMES_1 = {"names": "{0: 'person'}"}
NAMES_15 = {"names": str({i: f"class{i}" for i in range(15)})}  # DOTA's, an OBB export's
NMS_ARGS = {"args": "{'batch': 1, 'half': False, 'nms': True}"}


Shapes = list[list[int | str | None]]

DETECTED: list[tuple[Shapes, Mapping[str, str], tuple[str, int]]] = [
    # Ultralytics v8/v11 COCO export.
    ([[1, 84, 8400]], NAMES_80, ("yolov8", 80)),
    # Segmentation exports: by their task, or by a second output of mask prototypes.
    ([[1, 116, 8400], [1, 32, 160, 160]], {"task": "segment"}, ("segment", 80)),
    ([[1, 39, 525], [1, 32, 40, 40]], {}, ("segment", 3)),
    # Classification exports: by their task, or by their one rank-2 output.
    ([[1, 1000]], {"task": "classify"}, ("classify", 1000)),
    ([[1, 5]], {}, ("classify", 5)),
    # The same without metadata: the shape alone is enough.
    ([[1, 84, 8400]], {}, ("yolov8", 80)),
    # Single-class v8 head.
    ([[1, 5, 8400]], {}, ("yolov8", 1)),
    # Dynamic export: symbolic batch and anchors.
    ([["batch", 84, "anchors"]], NAMES_80, ("yolov8", 80)),
    # Original yolov5 export.
    ([[1, 25200, 85]], {}, ("yolov5", 80)),
    ([[1, 25200, 85]], NAMES_80, ("yolov5", 80)),
    ([[None, "anchors", 85]], {}, ("yolov5", 80)),
    # nms=True export.
    ([[1, 300, 6]], {**NAMES_80, **NMS_ARGS}, ("end2end", 80)),
    # YOLOv10-style end2end flag, one class: the flag rules out a 1-class yolov5.
    ([[1, 300, 6]], {**NAMES_1, "end2end": "True"}, ("end2end", 1)),
    # No flag, but 80 names cannot be a yolov5 head with 6 columns.
    ([[1, 300, 6]], NAMES_80, ("end2end", 80)),
    # One name, no flag, but a 'task' key: an ultralytics-package export, never yolov5-layout.
    ([[1, 300, 6]], {**NAMES_1, "task": "detect"}, ("end2end", 1)),
    # A false flag is no flag: one name and 6 columns (original yolov5 repo metadata).
    ([[1, 25200, 6]], {**NAMES_1, "stride": "32", "end2end": "False"}, ("yolov5", 1)),
    # No metadata at all: 6 columns read as a 1-class yolov5 head.
    ([[1, 300, 6]], {}, ("yolov5", 1)),
    # Explicit detect task.
    ([[1, 84, 8400]], {**NAMES_80, "task": "detect"}, ("yolov8", 80)),
]

REFUSED: list[tuple[Shapes, Mapping[str, str], list[str]]] = [
    # Rank 4 (rank 2 is a classifier's).
    ([[1, 2, 2, 2]], {}, ["[1, 2, 2, 2]", "rank 4"]),
    # Segmentation exports whose outputs do not add up: prototypes that are not 32, too few rows.
    ([[1, 116, 8400], [1, 16, 160, 160]], {"task": "segment"}, ["a segmentation model has outputs", "[1, 16, 160, 160]"]),
    ([[1, 116, 8400]], {"task": "segment"}, ["a segmentation model has outputs", "[1, 116, 8400]"]),
    ([[1, 116, 8400], [2, 32, 160, 160]], {}, ["a segmentation model has outputs", "[2, 32, 160, 160]"]),
    ([[1, 36, 8400], [1, 32, 160, 160]], {}, ["[1, 36, 8400]", "a segment head [1, 4+nc+32, N] needs >= 37"]),
    # Two outputs that are no segmentation export.
    ([[1, 84, 8400], [1, 84, 8400]], {}, ["exactly one detection output", "[1, 84, 8400], [1, 84, 8400]"]),
    # No outputs.
    ([], {}, ["none"]),
    # Names contradict the shape.
    ([[1, 84, 8400]], NAMES_3, ["[1, 84, 8400]", "80 classes", "3 classes"]),
    ([[1, 25200, 85]], NAMES_3, ["[1, 25200, 85]", "80 classes", "3 classes"]),
    # Metadata says NMS is inside, but the shape is not [1, K, 6].
    ([[1, 84, 8400]], {**NAMES_80, **NMS_ARGS}, ["[1, 84, 8400]", "[1, K, 6]"]),
    ([[1, 300, 7]], {"end2end": "True"}, ["[1, 300, 7]", "[1, K, 6]"]),
    # end2end without names: class count unknown.
    ([[1, 300, 6]], NMS_ARGS, ["[1, 300, 6]", "names"]),
    # Too few rows / columns for any head.
    ([[1, 4, 8400]], {}, ["[1, 4, 8400]", ">= 5"]),
    ([[1, 8400, 4]], {}, ["[1, 8400, 4]"]),
    # Batch other than 1.
    ([[2, 84, 8400]], {}, ["[2, 84, 8400]", "batch"]),
    # Square or fully symbolic: candidates and features cannot be told apart.
    ([[1, 6, 6]], {}, ["[1, 6, 6]"]),
    ([[1, "a", "b"]], {}, ["[1, a, b]"]),
    # Other tasks, named: pose, oriented boxes, classification, and one edged does not know.
    ([[1, 56, 8400]], {**NAMES_1, "task": "pose"}, ["pose", "[1, 56, 8400]"]),
    (
        [[1, 56, 8400]],
        {**NAMES_1, "task": "pose"},
        ["'pose' (pose estimation)", "detection, segmentation, classification and anomaly models only"],
    ),
    ([[1, 20, 21504]], {"task": "obb"}, ["'obb' (oriented bounding boxes)", "[1, 20, 21504]"]),
    # A pose export whose task metadata was lost still names its keypoints (it read as 52 classes).
    ([[1, 56, 8400]], {**NAMES_1, "kpt_shape": "[17, 3]"}, ["'pose' (pose estimation)", "[1, 56, 8400]"]),
    # An OBB export whose task metadata was lost: a detector's rows for its names, and one more (it read
    # as a yolov8 head whose names were one class short).
    ([[1, 20, 21504]], NAMES_15, ["OBB export", "oriented bounding boxes", "'task' metadata was lost", "[1, 20, 21504]"]),
    # A classifier's task with a detector's output, or names that count other classes.
    ([[1, 6, 8]], {"task": "classify"}, ["a classification model has one output [1, nc]", "[1, 6, 8]"]),
    ([[1, 5]], {**NAMES_1, "task": "classify"}, ["classifier of 5 classes", "metadata names 1 class"]),
    ([[1, 84, 8400]], {**NAMES_80, "task": "depth"}, ["model task 'depth' is not supported"]),
]


@pytest.mark.parametrize(("shapes", "metadata", "expected"), DETECTED)
def test_detect_head(shapes: Shapes, metadata: Mapping[str, str], expected: tuple[str, int]) -> None:
    assert detect_head(shapes, metadata) == expected


@pytest.mark.parametrize(("shapes", "metadata", "fragments"), REFUSED)
def test_detect_head_errors(shapes: Shapes, metadata: Mapping[str, str], fragments: list[str]) -> None:
    with pytest.raises(HeadError) as info:
        detect_head(shapes, metadata)
    for fragment in fragments:
        assert fragment in str(info.value)


def _outcome(shapes: Shapes, metadata: Mapping[str, str]) -> tuple[str, int] | str:
    try:
        return detect_head(shapes, metadata)
    except HeadError as e:
        return str(e)


@pytest.mark.parametrize("order", list(itertools.permutations(HEADS)))
def test_registry_order_does_not_matter(order: tuple[str, ...], monkeypatch: pytest.MonkeyPatch) -> None:
    # Formats must not overlap: at most one claims any output, whichever is asked first.
    cases = [(shapes, metadata) for shapes, metadata, _ in [*DETECTED, *REFUSED]]
    registered = [_outcome(*case) for case in cases]
    monkeypatch.setattr(registry, "HEADS", {name: HEADS[name] for name in order})
    assert [_outcome(*case) for case in cases] == registered


def test_errors_name_every_registered_layout() -> None:
    with pytest.raises(HeadError) as info:
        detect_head([[1, 2, 3, 4]], {})
    for name, head in HEADS.items():
        assert f"{head.layout} ({name})" in str(info.value)


def test_unknown_head_format_names_the_registered_ones() -> None:
    assert head_named("yolov5") is HEADS["yolov5"]
    with pytest.raises(HeadError, match="yolov9") as info:
        head_named("yolov9")
    assert str(tuple(HEADS)) in str(info.value)
    assert format_named("classify") is ClassifyHead and format_named("anomaly") is AnomalyHead
    assert format_named("segment") is HEADS["segment"]
    with pytest.raises(HeadError, match="yolov9") as info:
        format_named("yolov9")
    assert str(tuple(FORMATS)) in str(info.value)


def test_model_head_accepts_exactly_auto_and_the_registered_formats(tmp_path: Path) -> None:
    assert get_args(HeadName) == tuple(FORMATS)  # the settings name them without importing a head
    for name in ("auto", *FORMATS):
        assert ModelConfig(path=tmp_path / "m.onnx", head=name).head == name
    with pytest.raises(ValidationError) as info:
        ModelConfig(path=tmp_path / "m.onnx", head="yolov9")
    assert all(repr(name) in str(info.value) for name in ("auto", *FORMATS))


@pytest.mark.parametrize(
    ("shapes", "metadata", "expected"),
    [
        # 80 classes at imgsz 64: 8*8 + 4*4 + 2*2 = 84 candidates, fewer than its 116 rows.
        ([[1, 116, 84], [1, 32, 16, 16]], {**NAMES_80, "task": "segment"}, ("segment", 80)),
        ([[1, 116, 84], [1, 32, 16, 16]], {"task": "segment"}, ("segment", 80)),
        ([[1, 38, 20], [1, 32, 16, 16]], {}, ("segment", 2)),
        ([[1, 116, 116], [1, 32, 16, 16]], NAMES_80, ("segment", 80)),
    ],
)
def test_a_segmentation_export_with_fewer_candidates_than_rows_is_a_segment_head(
    shapes: Shapes, metadata: Mapping[str, str], expected: tuple[str, int]
) -> None:
    # Its prototypes say its features are the middle axis whatever the lengths: not a yolov5 head.
    assert detect_head(shapes, metadata) == expected


def test_without_prototypes_the_longer_axis_still_holds_the_candidates() -> None:
    assert detect_head([[1, 116, 84]], {}) == ("yolov5", 79)
    assert detect_head([[1, 84, 8400]], {}) == ("yolov8", 80)
