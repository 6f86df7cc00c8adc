"""A frame's task result: what the daemon, the outputs and the message builder know of it.

A head's decoder returns one result per frame (`edged.decode.Detections` for detection). Nothing
after it reads a result's arrays: the loop counts its problems, the outputs ask how many findings
it has, the evidence writer asks for its dataset label and near misses, and the message builder
asks for its message fields. Another task kind (instance masks with sizes, classes, an anomaly
map) is a head whose result answers these, with its message fields in `edged.messages`; nothing
in `edged.pipeline`, `edged.daemon` or the outputs changes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np


class TaskResult(Protocol):
    """One frame's result of the model's task; a view into its plan's buffers, valid until the plan's
    next frame (a consumer that keeps anything of it copies it)."""

    def __len__(self) -> int:
        """Its findings: a frame with none is empty, sent only where ``publish_empty`` says."""
        ...

    def problems(self) -> list[tuple[str, int]]:
        """What the model's output held that the result was built without, as (drop counter, how many
        values): a model broken or fed wrongly (`SPOILING`), or an outline thinned
        (`edged.pipeline.OUTPUT_PROBLEMS` says what to check)."""
        ...

    def near_misses(self) -> int:
        """Findings just below their threshold, which make the frame evidence under ``ng+near``."""
        ...

    def dataset_label(self, width: int, height: int) -> str:
        """The label file saved beside a ``width`` x ``height`` evidence image, in the format the task
        trains on (ultralytics' YOLO text for detection)."""
        ...

    def dataset_class(self) -> int | None:
        """The class an ultralytics classification dataset files the frame's image under (its folder),
        with no label file; None for a task whose label is a file (`dataset_label`)."""
        ...

    def heatmap(self) -> np.ndarray | None:
        """A map over the model's input to save beside the frame's evidence image (an anomaly model's
        map, uint8 0..255), a view valid until the next frame; None for a task without one."""
        ...

    def message_fields(
        self,
        label: Callable[[int], str],
        zones: Sequence[str | None] | None,
        thresholds: Sequence[float | None] | None,
        *,
        notes: Sequence[str | None] | None = None,
        mm_per_px: float | None = None,
    ) -> dict[str, Any]:
        """Its fields of the frame's message; ``zones``, ``thresholds`` and ``notes`` per finding with
        ``[inspect]``, and the camera's scale ``mm_per_px`` when it has one."""
        ...


# The problems after which a result's findings are not all the model's: values were dropped before
# its scores were judged. ``outline_thinned`` (a segmentation or anomaly result's) is not one: its findings are whole.
SPOILING = ("nonfinite_output", "score_above_one")


def output_problems(nonfinite: int, scores_above_one: int) -> list[tuple[str, int]]:
    """`TaskResult.problems` of a result that counted ``nonfinite`` values and ``scores_above_one``
    (scores outside 0..1): each drop counter with its count, those with none left out."""
    found = (("nonfinite_output", nonfinite), ("score_above_one", scores_above_one))
    return [(problem, count) for problem, count in found if count]
