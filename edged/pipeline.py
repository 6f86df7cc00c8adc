"""The per-frame path: preprocess -> inference -> decode, with a timer per stage.

A `FramePipeline` is planned for one frame size: the input tensor, the IOBinding and the decoder
scratch are all allocated here, once. `process` then only fills and reads those buffers. A frame
of another size is a new plan (the daemon re-plans when a camera renegotiates for good).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from edged.contract import ChannelOrder, FrameSpec
from edged.decode import Detections
from edged.geometry import BoxMap
from edged.messages import Detection, DetectionsMessage, ModelInfo, Timings
from edged.model import LoadedModel
from edged.preprocess import Preprocessor
from edged.sources import Frame


@dataclass(frozen=True, slots=True)
class StageTimes:
    preprocess_ms: float
    inference_ms: float
    decode_ms: float


class FramePipeline:
    """Preallocated buffers for one frame size, and the three stages that use them."""

    def __init__(self, model: LoadedModel, frame_w: int, frame_h: int, source_order: ChannelOrder) -> None:
        self.model = model
        self.spec = FrameSpec(frame_w, frame_h, source_order)
        self.preprocess = Preprocessor(model.contract, frame_w, frame_h, source_order)
        self.outputs = model.engine.bind(self.preprocess.tensor)
        self.decoder = model.make_decoder()

    @property
    def box_map(self) -> BoxMap:
        return self.preprocess.box_map

    def process(self, image: np.ndarray) -> tuple[Detections, StageTimes]:
        """Run one checked frame through the model; raises InferenceError from the engine."""
        t0 = time.perf_counter_ns()
        self.preprocess(image)
        t1 = time.perf_counter_ns()
        self.model.engine.run()
        t2 = time.perf_counter_ns()
        detections = self.decoder.decode(self.outputs[0], self.preprocess.box_map)
        t3 = time.perf_counter_ns()
        return detections, StageTimes((t1 - t0) / 1e6, (t2 - t1) / 1e6, (t3 - t2) / 1e6)


def detections_message(
    camera_id: str,
    seq: int,
    frame: Frame,
    box_map: BoxMap,
    model: LoadedModel,
    model_info: ModelInfo,
    detections: Detections,
    times: StageTimes,
    age_ms: float,
    thermal_state: str,
) -> DetectionsMessage:
    """The wire message for one processed frame: the one small object a frame allocates.

    Each column becomes a Python list in one ``tolist`` call, rather than one numpy scalar
    per value: that halves the cost of building the message.
    """
    boxes, scores, class_ids = detections.xyxy.tolist(), detections.scores.tolist(), detections.class_ids.tolist()
    return DetectionsMessage(
        camera_id=camera_id,
        seq=seq,
        frame_id=frame.frame_id,
        capture_time_ns=frame.t_wall_ns,
        frame_size=(box_map.frame_w, box_map.frame_h),
        input_size=(box_map.input_w, box_map.input_h),
        model=model_info,
        detections=[
            Detection(
                class_id=c,
                label=model.label(c),
                score=round(s, 4),
                box=(round(b[0], 1), round(b[1], 1), round(b[2], 1), round(b[3], 1)),
            )
            for b, s, c in zip(boxes, scores, class_ids, strict=True)
        ],
        timings=Timings(
            preprocess_ms=round(times.preprocess_ms, 3),
            inference_ms=round(times.inference_ms, 3),
            decode_ms=round(times.decode_ms, 3),
            age_ms=round(age_ms, 3),
        ),
        thermal_state=thermal_state,
    )
