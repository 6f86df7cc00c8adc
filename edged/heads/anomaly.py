"""The anomaly head: an anomalib 2.x ONNX export (PaDiM, PatchCore, ...), trained on good parts only.

Not a detection format: there are no candidates to select, so it is no `edged.heads.base.Head`;
`edged.anomaly` reads its outputs. anomalib names them, so they are recognised by name:
``pred_score`` (the image's normalised anomaly score, [1, 1], or [1] in PatchCore's),
``pred_label`` ([1, 1] or [1], bool),
``anomaly_map`` ([1, 1, H, W], normalised per pixel) and ``pred_mask`` ([1, 1, H, W] bool), or the
subset a model exports (the score is required). The export holds anomalib's pre- and
post-processing: a resize to the trained size (without antialiasing), the ImageNet
normalisation, and the score normalisation with the thresholds and min/max as constants, so that
0.5 is the threshold of both scores. It takes RGB values in 0..1, NCHW. The map comes out at the
trained size, which is how edged knows it: edged feeds the model at exactly that size, resized
with antialiasing as anomalib's training and ``Engine.predict`` do, so the in-graph resize is an
identity and the scores are the ones validated in training (`edged.preprocess`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar, Literal

from edged.errors import HeadError
from edged.heads.base import Dim, concrete, fmt_shape

OUTPUTS = ("pred_score", "pred_label", "anomaly_map", "pred_mask")
THRESHOLD = 0.5  # anomalib's normalised threshold: the export's scores are scaled to put it there


class AnomalyHead:
    """anomalib's named outputs: an image score, its label, and the map and mask at the trained size."""

    name: ClassVar[str] = "anomaly"
    layout: ClassVar[str] = "pred_score [1, 1], pred_label [1, 1] (or [1]), anomaly_map [1, 1, H, W], pred_mask [1, 1, H, W]"
    resize: ClassVar[Literal["antialias"]] = "antialias"

    @staticmethod
    def claims(output_names: Sequence[str]) -> bool:
        """Whether the outputs are an anomalib export's: an anomaly score and nothing but anomalib's names."""
        return "pred_score" in output_names and set(output_names) <= set(OUTPUTS)

    @classmethod
    def check(cls, outputs: Sequence[tuple[str, Sequence[Dim]]]) -> None:
        """`HeadError` unless ``outputs`` (name, shape) are anomalib's, for one image: a batch other
        than 1 (PatchCore's export is fixed at 2) cannot be served as anomalib scored it."""
        shown = ", ".join(f"{name} {fmt_shape(shape)}" for name, shape in outputs) or "none"
        names = [name for name, _ in outputs]
        if not cls.claims(names):
            raise HeadError(f"an anomaly model has the outputs {cls.layout} (anomalib's names); got {shown}")
        for name, shape in outputs:
            if name in ("pred_score", "pred_label"):  # [b, 1], or [b] as PatchCore's export has it
                fits = len(shape) in (1, 2) and all(concrete(d) == 1 for d in shape[1:])
            else:
                fits = len(shape) == 4 and concrete(shape[1]) == 1
            if not fits:
                raise HeadError(f"anomaly output {name} {fmt_shape(shape)}: expected {cls.layout}")
            batch = concrete(shape[0])
            if batch not in (None, 1):
                raise HeadError(
                    f"anomaly output {name} {fmt_shape(shape)} is fixed at a batch of {batch}: edged scores one "
                    "frame at a time, and a frame repeated to fill a batch is not what anomalib scored; re-export "
                    "the model with a batch of 1 (anomalib's PatchCore export is fixed at 2)"
                )
        if trained_size(outputs) is None and any(name in ("anomaly_map", "pred_mask") for name in names):
            raise HeadError(f"anomaly outputs {shown}: the map's height and width must be fixed (the trained size)")
        if (problem := sizes_differ(outputs)) is not None:
            raise HeadError(problem)


def trained_size(outputs: Sequence[tuple[str, Sequence[Dim]]]) -> tuple[int, int] | None:
    """[h, w] of the anomaly map (or mask) an anomalib export outputs: the size its pre-processing
    resizes to, which it was trained at; None when it outputs neither, or not at a fixed size."""
    for name, shape in outputs:
        if name in ("anomaly_map", "pred_mask") and len(shape) == 4:
            h, w = concrete(shape[2]), concrete(shape[3])
            if h is not None and w is not None:
                return h, w
    return None


def sizes_differ(outputs: Sequence[tuple[str, Sequence[Dim]]]) -> str | None:
    """Why the map and the mask of ``outputs`` (name, shape) cannot be read together: their fixed
    heights and widths differ, where anomalib's mask is its map thresholded, both at the trained
    size (`trained_size` reads either); None when they agree."""
    sizes = {
        name: (concrete(shape[2]), concrete(shape[3]))
        for name, shape in outputs
        if name in ("anomaly_map", "pred_mask") and len(shape) == 4
    }
    if len({size for size in sizes.values() if None not in size}) < 2:
        return None
    differ = " and ".join(f"{name} {fmt_shape(shape)}" for name, shape in outputs if name in sizes)
    return f"anomaly outputs {differ} differ in height and width: anomalib's mask is at its map's size (the trained size)"


def anomalib_size(outputs: Sequence[tuple[str, Sequence[Dim]]]) -> tuple[int, int] | None:
    """The size an engine pins and feeds a model with these outputs (name, shape) at: an anomalib
    export's `trained_size`; None for any other model."""
    return trained_size(outputs) if AnomalyHead.claims([name for name, _ in outputs]) else None
