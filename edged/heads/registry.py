"""The head formats edged reads, and telling which one a model's output is.

Each detection format is one module holding one `Head` subclass; adding a format means writing that
module and adding its class to `HEADS`. A classifier is `ClassifyHead`, an anomalib export
`AnomalyHead` (`FORMATS` holds them all). `detect_head` and the layouts named in its error messages
come from this registry; the allowed ``model.head`` values are `edged.config.HeadName`, the same names,
since the settings import no head.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TypeVar

from edged.errors import HeadError
from edged.heads.anomaly import AnomalyHead
from edged.heads.base import Dim, Head, OutputFacts, concrete, fmt_shape
from edged.heads.classify import ClassifyHead
from edged.heads.end2end import End2EndHead
from edged.heads.metadata import parse_names, says_nms_inside, says_rtdetr
from edged.heads.rtdetr import RtDetrHead
from edged.heads.segment import MASK_COEFFICIENTS, SegmentHead
from edged.heads.yolov5 import YoloV5Head
from edged.heads.yolov8 import YoloV8Head

HEADS: dict[str, type[Head]] = {head.name: head for head in (YoloV8Head, YoloV5Head, End2EndHead, RtDetrHead, SegmentHead)}
Format = type[Head] | type[ClassifyHead] | type[AnomalyHead]
FORMATS: dict[str, Format] = {**HEADS, ClassifyHead.name: ClassifyHead, AnomalyHead.name: AnomalyHead}
_F = TypeVar("_F", type[Head], Format)


def _listed(items: Sequence[str]) -> str:
    """'a, b or c'."""
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} or {items[-1]}"


_LAYOUTS = _listed([f"{head.layout} ({name})" for name, head in HEADS.items()])
_NMS_INSIDE_LAYOUTS = " or ".join(head.layout for head in HEADS.values() if not head.needs_nms)
# ultralytics' tasks edged does not serve, as its 'task' metadata names them.
_TASKS = {
    "pose": "pose estimation",
    "obb": "oriented bounding boxes",
}
_SERVED = "edged serves detection, segmentation, classification and anomaly models only"


def head_named(name: str) -> type[Head]:
    """The registered head format ``name``; `HeadError` for any other."""
    return _named(HEADS, name)


def format_named(name: str) -> Format:
    """The registered format ``name``, a classifier's and the anomaly head's included; `HeadError` for any other."""
    return _named(FORMATS, name)


def _named(registered: Mapping[str, _F], name: str) -> _F:
    found = registered.get(name)
    if found is None:
        raise HeadError(f"unknown head format {name!r}; expected one of {tuple(registered)}")
    return found


def detect_format(
    outputs: Sequence[tuple[str, Sequence[Dim]]], metadata: Mapping[str, str], forced: str = "auto"
) -> tuple[str, int]:
    """The format's name and class count from the outputs (name, shape): an anomalib export by its
    output names (or ``forced`` to ``anomaly``, ``model.head``), else the head `detect_head`
    finds. An anomaly model has one class, the anomaly."""
    if forced == AnomalyHead.name or AnomalyHead.claims([name for name, _ in outputs]):
        AnomalyHead.check(outputs)
        return AnomalyHead.name, 1
    return detect_head([shape for _, shape in outputs], metadata)


def detect_head(output_shapes: Sequence[Sequence[Dim]], metadata: Mapping[str, str]) -> tuple[str, int]:
    """The head format's name and the class count, from the output shapes and ultralytics metadata.

    A symbolic dimension (str or None, as ONNX Runtime reports dynamic axes) is taken as the
    candidate count. The one format whose `Head.matches` claims the output wins; a model whose
    metadata says NMS is inside can only be a format that needs none. Known names must agree
    with the shape. A classifier is `ClassifyHead`'s. Raises `HeadError` naming the shape otherwise.
    """
    if ClassifyHead.claims(output_shapes, metadata.get("task")):
        names = parse_names(metadata)
        return ClassifyHead.name, ClassifyHead.classes(output_shapes, None if names is None else len(names))
    _refuse_other_tasks(output_shapes, _task(metadata))
    prototypes = _prototypes(output_shapes, metadata.get("task"))
    if len(output_shapes) != 1 + prototypes:
        shown = ", ".join(fmt_shape(shape) for shape in output_shapes) or "none"
        raise HeadError(f"expected exactly one detection output {_LAYOUTS}; got {shown}")
    facts = _read_facts(list(output_shapes[0]), metadata, prototypes=prototypes)
    _refuse_oriented_boxes(facts)
    for name, head in HEADS.items():
        if facts.nms_inside and head.needs_nms:
            continue
        num_classes = head.matches(facts)
        if num_classes is not None:
            return name, num_classes
    shown = fmt_shape(facts.shape)
    if facts.nms_inside:
        raise HeadError(f"metadata says NMS is inside the model, but output {shown} is not {_NMS_INSIDE_LAYOUTS}")
    side = "columns" if facts.candidates_in_rows else "rows"
    raise HeadError(f"output {shown} has {facts.features} {side}; expected {_LAYOUTS}")


def _task(metadata: Mapping[str, str]) -> str | None:
    """ultralytics' ``task`` metadata; a pose export whose task was lost (re-saved by a tool that keeps
    only some keys) still names its keypoints, ``kpt_shape``, and would read as a detector of 52 classes."""
    return metadata.get("task") or ("pose" if metadata.get("kpt_shape") else None)


def _refuse_other_tasks(output_shapes: Sequence[Sequence[Dim]], task: str | None) -> None:
    """`HeadError` naming the task of a model edged does not serve, from ultralytics' ``task`` metadata."""
    shown = ", ".join(fmt_shape(shape) for shape in output_shapes) or "none"
    if task not in (None, "detect", "segment"):
        what = f"{task!r} ({_TASKS[task]})" if task in _TASKS else repr(task)
        raise HeadError(f"model task {what} is not supported (outputs {shown}); {_SERVED}")


def _refuse_oriented_boxes(facts: OutputFacts) -> None:
    """`HeadError` naming an OBB export whose ``task`` metadata was lost: nothing else in its metadata
    says OBB, but its rows are a detector's for the classes it names plus one, the boxes' angle (a
    yolov5 head's extra column, its objectness, comes with the candidates in rows)."""
    if facts.n_names is None or facts.candidates_in_rows or facts.prototypes or facts.nms_inside:
        return
    if facts.features == 4 + facts.n_names + 1:
        raise HeadError(
            f"output {fmt_shape(facts.shape)} has 4 + {facts.n_names} + 1 rows for the {facts.n_names} classes its "
            f"metadata names: an OBB export's ({_TASKS['obb']}, the angle last) whose 'task' metadata was lost; "
            f"{_SERVED}"
        )


def _prototypes(output_shapes: Sequence[Sequence[Dim]], task: str | None) -> bool:
    """Whether the model is a segmentation export: its task says so, or a second output of rank 4
    (the mask prototypes); `HeadError` when it is one and the prototypes are not [1, 32, h, w] (batch 1,
    as the detection output: one frame's masks)."""
    second = output_shapes[1] if len(output_shapes) == 2 else None
    if task != "segment" and (second is None or len(second) != 4):
        return False
    if (
        second is None
        or len(second) != 4
        or concrete(second[1]) != MASK_COEFFICIENTS
        or concrete(second[0]) not in (None, 1)
    ):
        shown = ", ".join(fmt_shape(shape) for shape in output_shapes) or "none"
        raise HeadError(f"a segmentation model has outputs {SegmentHead.layout}; got {shown}")
    return True


def _read_facts(shape: list[Dim], metadata: Mapping[str, str], *, prototypes: bool = False) -> OutputFacts:
    """The facts of a single output; `HeadError` for a shape no format has."""
    task = metadata.get("task")
    names = parse_names(metadata)
    features, candidates_in_rows = _feature_dim(shape, features_first=prototypes)
    return OutputFacts(
        shape=tuple(shape),
        features=features,
        candidates_in_rows=candidates_in_rows,
        n_names=None if names is None else len(names),
        from_ultralytics=task is not None,
        nms_inside=says_nms_inside(metadata),
        rtdetr=says_rtdetr(metadata),
        prototypes=prototypes,
    )


def _feature_dim(shape: list[Dim], *, features_first: bool = False) -> tuple[int, bool]:
    """(feature count, whether candidates are rows) of a rank-3, batch-1 output shape.

    Mostly the longer axis holds the candidates. ``features_first``: a segmentation export's (it has
    the prototypes output), whose features are always the middle axis, as ultralytics lays out its
    Segment head: at a small imgsz it has fewer candidates than rows (80 classes at imgsz 64 are
    [1, 116, 84]), which the lengths alone would take for a yolov5 head.
    """
    if len(shape) != 3:
        raise HeadError(f"output {fmt_shape(shape)} has rank {len(shape)}; expected {_LAYOUTS}")
    batch, a, b = (concrete(d) for d in shape)
    if batch not in (None, 1):
        raise HeadError(f"output {fmt_shape(shape)} has batch {batch}; expected batch 1")
    if a is not None and (b is None or a < b or features_first):
        return a, False
    if b is not None and (a is None or a > b):
        return b, True
    raise HeadError(f"output {fmt_shape(shape)}: cannot tell candidates from features; expected {_LAYOUTS}")
