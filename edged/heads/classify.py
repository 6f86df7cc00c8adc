"""The classify head: ultralytics' ``-cls`` export, [1, nc] class probabilities (its softmax is inside).

Not a detection format: there are no candidates to select, so it is no `edged.heads.base.Head`;
`edged.classify` reads its output. It is recognised from ultralytics' ``task: classify`` metadata,
or from a rank-2 output, which no detection format has. Ultralytics feeds it its classification
preprocessing (shortest side resized to the input, centre crop), never the letterbox.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar, Literal

from edged.errors import HeadError
from edged.heads.base import Dim, concrete, fmt_classes, fmt_shape


class ClassifyHead:
    """The one output [1, nc]: one probability per class."""

    name: ClassVar[str] = "classify"
    layout: ClassVar[str] = "[1, nc]"
    resize: ClassVar[Literal["crop"]] = "crop"

    @staticmethod
    def claims(output_shapes: Sequence[Sequence[Dim]], task: str | None) -> bool:
        """Whether the outputs are a classifier's: its task says so, or one rank-2 output."""
        return task == "classify" or (len(output_shapes) == 1 and len(output_shapes[0]) == 2)

    @classmethod
    def classes(cls, output_shapes: Sequence[Sequence[Dim]], n_names: int | None) -> int:
        """The class count of a classifier's outputs; `HeadError` when they are not [1, nc] or the
        metadata's names count other classes."""
        shown = ", ".join(fmt_shape(shape) for shape in output_shapes) or "none"
        if len(output_shapes) != 1 or len(output_shapes[0]) != 2:
            raise HeadError(f"a classification model has one output {cls.layout}; got {shown}")
        batch, nc = (concrete(d) for d in output_shapes[0])
        if batch not in (None, 1) or nc is None:
            raise HeadError(f"classification output {shown}: expected [1, nc] with a fixed class count")
        if n_names is not None and n_names != nc:
            raise HeadError(
                f"output {shown} is a classifier of {fmt_classes(nc)}, but metadata names {fmt_classes(n_names)}"
            )
        return nc
