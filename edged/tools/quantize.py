"""``edged quantize``: a static INT8 copy of a model, and what it gains and costs on this machine.

The recipe is onnxruntime's own. ``quant_pre_process`` runs symbolic shape inference and graph
optimisation. ``quantize_static`` then writes QDQ (QuantizeLinear/DequantizeLinear pairs, which
the CPU EP fuses into integer kernels and which TensorRT and OpenVINO also read). Weights are
int8 per output channel and activations uint8.

The convolutions that read the image stay float (see `find_stem`): over 3 input channels
onnxruntime's int8 convolution misses its fast kernels and is slower than float. Quantised
instead (``--no-float-stem``), they let the INT8 model take the camera's uint8 pixels as they
are: when the input is pixels times a scale, that scale with zero point 0 is the input's
quantisation (see `pixel_scale`), so preprocess skips its float pass and the model its first
QuantizeLinear. Which is faster depends on the board's kernels; the report says.

``reduce_range`` (7-bit weights) is off by default. The deployment targets are ARM: NEON and
ARMv8.2 dot-product kernels widen u8 x s8 products, so nothing saturates and the eighth bit is
pure precision. x86 CPUs with VNNI are the same. Only x86 without VNNI (AVX2 ``vpmaddubsw``) can
saturate its 16-bit pair sums, and ``--reduce-range`` exists for that case.

Calibration frames go through the daemon's own preprocessor (`edged.preprocess.preprocessor`),
built from the model's contract, so the ranges are those of what the deployed model sees,
letterbox grey included. Ranges default
to the 99.999th percentile, which lost less mAP than MinMax on the demo model. The detection
head is kept in float (see `find_head`): box coordinates in input pixels and 0..1 scores share
its last tensors, and one uint8 scale cannot hold both. The result is then compared with the
original: the median per-frame time of `FramePipeline.process`, interleaved on the bench's
1280x720 frame, and accuracy on held-out scenes or on the user's images (``--data``): against the
FP32 model's own boxes and OK/NG verdicts (`edged.tools.agreement`, no labels needed) and, where
there are labels, through `edged.tools.evaluate`.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import numpy as np
import onnx
from onnxruntime.quantization import (
    CalibrationDataReader,
    CalibrationMethod,
    QuantFormat,
    QuantType,
    quantize_static,
)
from onnxruntime.quantization.shape_inference import quant_pre_process

from edged.config import ModelConfig, RuntimeConfig, check_thread_option, load_config
from edged.contract import InputContract
from edged.engines import is_quantised
from edged.errors import ContractError, DataError, InferenceError, ModelError, QuantizeError, UsageError
from edged.files import refuse_overwriting, write_whole, write_with
from edged.model import LoadedModel, load_model, require_task
from edged.pipeline import FramePipeline
from edged.preprocess import AntialiasPreprocessor, Preprocessor, preprocessor
from edged.settings.inspect import InspectConfig
from edged.tools.agreement import (
    Agreement,
    ClassAgreement,
    agreement,
    camera_inspection,
    check_inspection,
    class_agreement,
    labelled,
)
from edged.tools.bench import machine_info
from edged.tools.bench_rows import Row, TimedFrame, bench_frame, interleave
from edged.tools.evaluate import (
    EvalSample,
    ProgressBar,
    check_labels,
    check_scene_classes,
    evaluate,
    folder_samples,
    image_files,
    scene_samples,
)
from edged.tools.metrics import EvalReport

HEAVY_OPS = frozenset({"Conv", "ConvTranspose", "Gemm", "MatMul"})
METHODS = {"minmax": CalibrationMethod.MinMax, "percentile": CalibrationMethod.Percentile}
CALIB_CHUNK = 16  # frames whose activations onnxruntime holds at once while calibrating
MAP_CONF, MAP_IOU, MAX_DET, REPORT_CONF = 0.001, 0.7, 300, 0.25  # as `edged eval` scores by default
SCENE_SIZE = (1280, 720)
LATENCY_WARMUP = 20
# Fewer calibration frames than this is warned of: on the demo model, INT8 calibrated on 2 scenes lost
# 2.6 points of mAP@0.5 on held-out scenes, on 8 or more 0.2; on 1 unlike photo, 20 points of mAP@0.5:0.95.
FEW_CALIBRATION_FRAMES = 8


@dataclass(frozen=True, slots=True)
class FloatNodes:
    """Nodes to keep in float, each with its op type, and why (or why none)."""

    nodes: dict[str, str]
    reason: str


@dataclass(frozen=True, slots=True)
class Quantised:
    """What `quantize` kept in float, and whether the INT8 model takes uint8 pixels."""

    head: FloatNodes
    stem: FloatNodes
    pixel_input: bool


# ---- the head ---------------------------------------------------------------------------------


def _reach(nodes: list[onnx.NodeProto], seeds: Iterable[int], forward: bool) -> set[int]:
    """Indices of the nodes strictly downstream (forward) or upstream of the seeds."""
    producer = {t: i for i, n in enumerate(nodes) for t in n.output}
    consumers: dict[str, list[int]] = {}
    for i, n in enumerate(nodes):
        for t in n.input:
            consumers.setdefault(t, []).append(i)
    found: set[int] = set()
    stack = list(seeds)
    while stack:
        n = nodes[stack.pop()]
        if forward:
            nxt = [j for t in n.output for j in consumers.get(t, [])]
        else:
            nxt = [producer[t] for t in n.input if t in producer]
        for j in nxt:
            if j not in found:
                found.add(j)
                stack.append(j)
    return found


def _candidate_count(graph: onnx.GraphProto) -> int | None:
    """N of a [1, 4+nc, N] or [1, N, 5+nc] head: the larger static non-batch dimension."""
    dims = [d.dim_value for d in graph.output[0].type.tensor_type.shape.dim]
    return max(dims[1:]) if len(dims) == 3 and all(dims) else None


def _candidate_region(model: onnx.ModelProto, heavy: set[int]) -> set[int]:
    """Nodes from the first tensor shaped by the N candidates on (e.g. a DFL decode); empty when
    that region holds more than one heavy op, i.e. is real network rather than decode."""
    graph, nodes = model.graph, list(model.graph.node)
    n = _candidate_count(graph)
    if n is None:
        return set()
    infos = [*graph.value_info, *graph.output]
    shaped = {v.name for v in infos if n in [d.dim_value for d in v.type.tensor_type.shape.dim][1:]}
    seeds = {i for i, node in enumerate(nodes) if shaped.intersection(node.output)}
    region = seeds | _reach(nodes, seeds, forward=True)
    return region if len(region & heavy) <= 1 else set()


def find_head(model: onnx.ModelProto) -> FloatNodes:
    """The decode head: nodes after the last Conv/Gemm/MatMul (sigmoid, box math, final concat),
    plus the region that carries the candidate axis (a DFL convolution) when there is one.

    Works on any graph; finding nothing means excluding nothing, and the reason says so. Node
    names are what onnxruntime excludes by, so unnamed nodes need `name_nodes` first.
    """
    nodes = list(model.graph.node)
    heavy = {i for i, n in enumerate(nodes) if n.op_type in HEAVY_OPS}
    if not heavy:
        return FloatNodes({}, "the graph has no Conv/Gemm/MatMul, so no head to tell apart; excluding nothing")
    tail = _reach(nodes, heavy, forward=True) - _reach(nodes, heavy, forward=False) - heavy
    region = _candidate_region(model, heavy)
    picked = sorted(tail | region)
    if not picked:
        return FloatNodes(
            {}, "the output comes straight from a Conv/Gemm/MatMul; nothing after it to keep in float; excluding nothing"
        )
    why = (
        "after the last Conv/Gemm/MatMul: the output's decode (a detector's box math, sigmoid and final "
        "concat, whose tensors mix input-pixel coordinates with 0..1 scores; a classifier's softmax)"
    )
    if region - tail:
        why += f", plus the {len(region - tail)} node(s) that decode the candidate axis"
    return FloatNodes({nodes[i].name: nodes[i].op_type for i in picked}, why)


def find_stem(model: onnx.ModelProto) -> FloatNodes:
    """The Conv/Gemm/MatMul nodes that read the model's input (the image) directly."""
    graph = model.graph
    inputs = {i.name for i in graph.input} - {t.name for t in graph.initializer}  # old IRs list weights too
    stem = {n.name: n.op_type for n in graph.node if n.op_type in HEAVY_OPS and inputs & set(n.input)}
    if not stem:
        return FloatNodes({}, "no Conv/Gemm/MatMul reads the input directly; excluding nothing")
    return FloatNodes(
        stem,
        "read the image: onnxruntime's int8 convolution over 3 input channels has no fast "
        "kernel and runs slower than float (the demo model's stem: 0.89 ms against 0.35 ms "
        "on x86 with VNNI)",
    )


# ---- calibration ------------------------------------------------------------------------------


class CalibrationFrames(CalibrationDataReader):  # type: ignore[misc]  # onnxruntime.quantization is untyped
    """Frames -> the daemon's input tensors, handed out a chunk at a time.

    onnxruntime calls `set_range` per chunk (``CalibStridedMinMax``) and keeps only that chunk's
    activations, so memory does not grow with the number of frames.
    """

    def __init__(
        self, contract: InputContract, frames: Iterator[EvalSample], total: int, progress_to: TextIO | None = None
    ) -> None:
        self._contract, self._frames, self._total, self._progress_to = contract, frames, total, progress_to
        self._progress: ProgressBar | None = None
        self._plan: Preprocessor | AntialiasPreprocessor | None = (
            None  # the last size's only: a folder of crops has as many sizes as images
        )
        self._left = total
        self.done = 0

    def __len__(self) -> int:
        return self._total

    @property
    def input_name(self) -> str:
        return self._contract.input_name

    def set_range(self, start_index: int, end_index: int) -> None:
        self._left = end_index - start_index

    def get_next(self) -> dict[str, np.ndarray] | None:
        self._report()
        frame = next(self._frames, None) if self._left > 0 else None
        if frame is None:
            return None
        self._left -= 1
        h, w = frame.image.shape[:2]
        if self._plan is None or (self._plan.box_map.frame_w, self._plan.box_map.frame_h) != (w, h):
            self._plan = preprocessor(self._contract, w, h, "bgr")
        tensor = self._plan(frame.image).copy()  # the plan's tensor is reused by the next frame
        self.done += 1
        return {self._contract.input_name: tensor}

    def _report(self) -> None:
        """Progress as onnxruntime asks for the next frame, once it has run those handed out before: a
        frame counted as it is handed out would be timed by its preprocessing alone."""
        if self._progress_to is None:
            return
        if self._progress is None:
            self._progress = ProgressBar(self._total, self._progress_to)  # the clock starts with the first frame
        elif self.done:
            self._progress.update(self.done)


def few_frames(total: int) -> str:
    """A warning when ``total`` calibration frames are too few for ranges that hold on the line's
    other frames; "" otherwise. Quantising goes on: the comparison shows what it cost."""
    if total >= FEW_CALIBRATION_FRAMES:
        return ""
    return (
        f"warning: calibrating on {total} frame(s), fewer than {FEW_CALIBRATION_FRAMES}: the activation ranges "
        "of so few rarely hold for other frames, and the INT8 model may lose much accuracy; calibrate on some "
        "hundred frames like the line's"
    )


def chunk_size(total: int) -> int:
    """The largest divisor of total up to CALIB_CHUNK (onnxruntime wants equal chunks)."""
    return max(d for d in range(1, min(total, CALIB_CHUNK) + 1) if total % d == 0)


def name_nodes(model: onnx.ModelProto) -> None:
    """Give unnamed nodes unique names: onnxruntime excludes nodes by name only."""
    taken = {n.name for n in model.graph.node}
    for i, node in enumerate(model.graph.node):
        if not node.name:
            name = f"{node.op_type}_{i}"
            while name in taken:
                name += "_"
            node.name = name
            taken.add(name)


def pixel_scale(contract: InputContract) -> float | None:
    """The input's quantisation scale that makes its uint8 codes the camera's pixels, or None.

    A float input that is pixels x scale (no mean, no std) quantises with that scale and zero
    point 0 to exactly the 0..255 pixel values, so the INT8 model can take the pixels as they
    are: preprocess skips its float pass and the model its first QuantizeLinear.
    """
    plain = contract.dtype is np.float32 and not any(contract.mean) and all(s == 1 for s in contract.std)
    return contract.scale if plain else None


def read_pixels(model: onnx.ModelProto, input_name: str) -> bool:
    """Make the model's input the uint8 codes of its QuantizeLinear, which then goes; False, and
    the model untouched, when a float node reads the input too."""
    graph = model.graph
    consumers = [n for n in graph.node if input_name in n.input]
    if not consumers or any(n.op_type != "QuantizeLinear" for n in consumers):
        return False
    for q in consumers:
        for node in graph.node:
            node.input[:] = [input_name if t == q.output[0] else t for t in node.input]
        graph.node.remove(q)
    next(i for i in graph.input if i.name == input_name).type.tensor_type.elem_type = onnx.TensorProto.UINT8
    return True


def quantize(
    src: Path,
    dst: Path,
    frames: CalibrationFrames,
    *,
    method: str = "percentile",
    exclude_head: bool = True,
    float_stem: bool = True,
    reduce_range: bool = False,
    pixel_input: float | None = None,
) -> Quantised:
    """Write the QDQ INT8 model to dst; returns what stayed float and the input it takes.

    With ``pixel_input`` (see `pixel_scale`) the input is quantised with that scale and zero
    point 0, and when only quantised nodes read it the written model takes uint8 pixels.
    """
    input_name = frames.input_name
    overrides = (
        {input_name: [{"scale": np.array(pixel_input, np.float32), "zero_point": np.array(0, np.uint8)}]}
        if pixel_input is not None
        else {}
    )
    with tempfile.TemporaryDirectory(prefix="edged-quantize.") as tmp:
        prepared = Path(tmp) / "prepared.onnx"
        try:
            quant_pre_process(src, prepared)
            model = onnx.load(prepared)
            name_nodes(model)
            onnx.save(model, prepared)
            head = find_head(model) if exclude_head else FloatNodes({}, "head exclusion turned off (--no-exclude-head)")
            stem = find_stem(model) if float_stem else FloatNodes({}, "quantised too (--no-float-stem)")
            with contextlib.redirect_stdout(io.StringIO()):  # the histogram calibrators print()
                quantize_static(
                    prepared,
                    dst,
                    frames,
                    quant_format=QuantFormat.QDQ,
                    per_channel=True,
                    reduce_range=reduce_range,
                    activation_type=QuantType.QUInt8,
                    weight_type=QuantType.QInt8,
                    nodes_to_exclude=[*head.nodes, *stem.nodes],
                    calibrate_method=METHODS[method],
                    extra_options={"CalibStridedMinMax": chunk_size(len(frames)), "TensorQuantOverrides": overrides},
                )
        except DataError:  # a calibration image: the user's data, not the quantiser, at fault
            raise
        except Exception as e:  # onnx and onnxruntime raise many unrelated types here
            raise QuantizeError(f"quantising {src} failed: {type(e).__name__}: {e}") from e
    pixels = False
    if pixel_input is not None:
        model = onnx.load(dst)
        pixels = read_pixels(model, input_name)
        if pixels:
            onnx.save(model, dst)
    return Quantised(head, stem, pixels)


# ---- before/after -----------------------------------------------------------------------------


@dataclass(slots=True)
class Comparison:
    """Both models measured the same way; empty where a measurement was skipped."""

    latency_ms: dict[str, float] = field(default_factory=dict)  # whole frame
    inference_ms: dict[str, float] = field(default_factory=dict)  # the engine's run alone
    latency_frames: int = 0
    accuracy: dict[str, EvalReport] = field(default_factory=dict)
    accuracy_data: str = ""
    agreement: Agreement | ClassAgreement | None = None  # against FP32's own boxes or best class: needs no labels

    @property
    def speedup(self) -> float | None:
        return self.latency_ms["fp32"] / self.latency_ms["int8"] if self.latency_ms else None

    @property
    def inference_speedup(self) -> float | None:
        return self.inference_ms["fp32"] / self.inference_ms["int8"] if self.inference_ms else None

    @property
    def map50_delta_points(self) -> float | None:
        a = self.accuracy
        return 100 * (a["int8"].map50 - a["fp32"].map50) if a else None


def _interface(model: LoadedModel) -> list[tuple[str, str, Any, str]]:
    engine = model.engine
    return [("input", i.name, list(i.shape), i.type) for i in engine.input_meta] + [
        ("output", o.name, list(o.shape), o.type) for o in engine.output_meta
    ]


def load_quantised(
    path: Path, original: LoadedModel, pixel_input: bool = False, *, named: Path | None = None
) -> LoadedModel:
    """Load the INT8 model as the daemon would, with the original's runtime settings, and check it
    kept the original's interface, but for a uint8 input when it was quantised to take pixels.
    ``named``: the file the errors name, where ``path`` is the one it will be moved to."""
    try:
        model = load_model(original.cfg.model_copy(update={"path": path}), original.engine.cfg)
    except (ModelError, ContractError) as e:
        raise QuantizeError(f"the quantised model {named or path} does not load: {e}") from None
    expected = _interface(original)
    if pixel_input:
        expected = [(kind, name, shape, "tensor(uint8)" if kind == "input" else t) for kind, name, shape, t in expected]
    if _interface(model) != expected:
        raise QuantizeError(f"the quantised model changed the interface: {expected} -> {_interface(model)}")
    return model


def _timed(plan: FramePipeline, image: np.ndarray) -> Row:
    def row() -> TimedFrame:
        t0 = time.perf_counter_ns()
        _, times = plan.process(image)
        return TimedFrame((time.perf_counter_ns() - t0) / 1e6, {"inference": times.inference_ms})

    return row


def measure_latency(models: dict[str, LoadedModel], frames: int) -> tuple[dict[str, float], dict[str, float]]:
    """Median ms per frame of the full per-frame path, and of its inference alone, the models
    interleaved after a warm-up."""
    image = bench_frame()
    h, w = image.shape[:2]
    rows = {name: _timed(FramePipeline(m, w, h, "bgr"), image) for name, m in models.items()}
    samples = interleave(rows, frames, LATENCY_WARMUP)
    frame = {name: float(np.median([s.total_ms for s in runs])) for name, runs in samples.items()}
    inference = {name: float(np.median([s.stages["inference"] for s in runs])) for name, runs in samples.items()}
    return frame, inference


def compare(
    models: dict[str, LoadedModel],
    *,
    latency_frames: int,
    eval_scenes: int,
    eval_seed: int,
    data: Path | None = None,
    inspect: InspectConfig | None = None,
    conf: float = REPORT_CONF,
    log: TextIO = sys.stderr,
) -> Comparison:
    """Latency, agreement with FP32's boxes (and verdicts under ``inspect``) and, with labels, accuracy
    of each model, on the images under ``data`` or on held-out scenes; raises QuantizeError if a run fails."""
    result = Comparison()
    classifier = models["fp32"].task == "classify"  # compared by its best class: no box labels to read

    def samples() -> tuple[int, Iterator[EvalSample]]:
        if data is not None:
            return folder_samples(data, None if classifier else models["fp32"].num_classes)
        return scene_samples(eval_scenes, eval_seed, *SCENE_SIZE)

    try:
        if latency_frames > 0:
            print(
                f"timing {' vs '.join(models)} on a {'x'.join(map(str, SCENE_SIZE))} frame, "
                f"{latency_frames} interleaved frames each ...",
                file=log,
            )
            result.latency_ms, result.inference_ms = measure_latency(models, latency_frames)
            result.latency_frames = latency_frames
        if data is not None or eval_scenes > 0:
            result.accuracy_data = f"images {data}" if data is not None else f"scenes seed={eval_seed} n={eval_scenes}"
            print(
                f"comparing int8 with fp32's {'best class' if classifier else 'boxes'} on {result.accuracy_data} ...",
                file=log,
            )
            total, frames = samples()
            compared = class_agreement if classifier else agreement
            result.agreement = compared(
                models["fp32"], models["int8"], frames, inspect=inspect, conf=conf, progress=ProgressBar(total, log)
            )
            labels = not classifier and (data is None or labelled(data))
            for name, model in models.items() if labels else ():
                print(f"evaluating {name} against the labels of {result.accuracy_data} ...", file=log)
                total, frames = samples()
                result.accuracy[name] = evaluate(model, frames, total, REPORT_CONF, ProgressBar(total, log))
    except InferenceError as e:
        raise QuantizeError(f"running the models failed: {e}") from None
    return result


def format_comparison(c: Comparison) -> str:
    lines = [f"{'':<18}{'FP32':>10}{'INT8':>10}  change"] if c.latency_ms or c.accuracy else []
    if c.latency_ms:
        fp, q = c.latency_ms["fp32"], c.latency_ms["int8"]
        lines.append(
            f"{'ms per frame':<18}{fp:>10.2f}{q:>10.2f}  {c.speedup:.2f}x "
            f"(median of {c.latency_frames}, FramePipeline.process, interleaved)"
        )
        fp, q = c.inference_ms["fp32"], c.inference_ms["int8"]
        lines.append(
            f"{'ms inference':<18}{fp:>10.2f}{q:>10.2f}  {c.inference_speedup:.2f}x "
            "(the engine's IOBinding run within those frames)"
        )
    if c.accuracy:
        for label, key in (
            ("mAP@0.5", "map50"),
            ("mAP@0.5:0.95", "map50_95"),
            ("precision", "precision"),
            ("recall", "recall"),
        ):
            fp, q = getattr(c.accuracy["fp32"], key), getattr(c.accuracy["int8"], key)
            lines.append(f"{label:<18}{fp:>10.3f}{q:>10.3f}  {100 * (q - fp):+.1f} points")
        lines.append(f"(accuracy on {c.accuracy_data}; precision and recall at conf {REPORT_CONF:g})")
    if c.agreement is not None:
        lines.append(f"int8 {c.agreement.format()}")
    return "\n".join(lines)


def report_document(
    args: argparse.Namespace,
    original: LoadedModel,
    quantised: LoadedModel,
    result: Quantised,
    calibration: str,
    c: Comparison,
) -> dict[str, Any]:
    return {
        "model": str(args.model),
        "model_sha256": original.engine.identity.sha256,
        "int8_model": str(args.out),
        "int8_sha256": quantised.engine.identity.sha256,
        "quantization": {
            "format": "QDQ",
            "weights": "int8 per-channel",
            "activations": "uint8",
            "input": quantised.contract.describe(),
            "reduce_range": args.reduce_range,
            "calibration_method": args.method,
            "calibration_data": calibration,
        },
        "excluded_nodes": {**result.head.nodes, **result.stem.nodes},
        "exclusion_reason": {"head": result.head.reason, "stem": result.stem.reason},
        "latency": {
            "frame": "x".join(map(str, SCENE_SIZE)),
            "frames": c.latency_frames,
            "intra_op_threads": original.engine.cfg.intra_op_threads,
            "warmup": LATENCY_WARMUP,
            "fp32_median_ms": c.latency_ms.get("fp32"),
            "int8_median_ms": c.latency_ms.get("int8"),
            "speedup": c.speedup,
            "fp32_inference_median_ms": c.inference_ms.get("fp32"),
            "int8_inference_median_ms": c.inference_ms.get("int8"),
            "inference_speedup": c.inference_speedup,
        },
        "accuracy": {
            "data": c.accuracy_data,
            "map50_delta_points": c.map50_delta_points,
            **{name: r.to_dict() for name, r in c.accuracy.items()},
            "agreement": c.agreement.to_dict() if c.agreement is not None else None,
        },
        "machine": machine_info(),
    }


# ---- the command ------------------------------------------------------------------------------


def _check_args(args: argparse.Namespace) -> None:
    try:
        check_thread_option(args.threads)
    except ValueError as e:
        raise UsageError(str(e)) from None
    refuse_overwriting({"--out": args.out, "--report": args.report}, {"--model": args.model, "--config": args.config})
    if args.model.is_file() and is_quantised(args.model):
        raise UsageError(
            f"{args.model} is already quantised (an `edged quantize` model): quantise the FP32 model it was made from"
        )


def _calibration(args: argparse.Namespace, model: LoadedModel) -> tuple[str, CalibrationFrames]:
    if args.calib_images is not None:
        total, frames = folder_samples(args.calib_images, None)  # pixels only
        source = f"images {args.calib_images} n={total}"
    else:
        total, frames = scene_samples(args.calib_scenes, args.seed, *SCENE_SIZE)
        source = f"scenes seed={args.seed} n={total}"
        if args.seed == args.eval_seed and args.eval_scenes:
            print(
                f"warning: calibrating on the evaluation seed {args.seed}; the accuracy figures will flatter the INT8 model",
                file=sys.stderr,
            )
    print(f"calibrating ({args.method}) on {source} ...", file=sys.stderr)
    if warning := few_frames(total):
        print(warning, file=sys.stderr)
    return source, CalibrationFrames(model.contract, frames, total, sys.stderr)


def _inspection(config: Path | None, camera_id: str | None) -> tuple[InspectConfig | None, float]:
    """The inspection of ``config``'s camera ``camera_id`` (its first without) and its ``model.conf``,
    which the verdicts are compared under; none without ``config``."""
    if config is None:
        if camera_id is not None:
            raise UsageError("--camera names a camera of --config: give the configuration too")
        return None, REPORT_CONF
    settings = load_config(config)
    return camera_inspection(settings, camera_id), settings.model.conf


def print_result(result: Quantised, contract: InputContract, out: TextIO) -> None:
    for part in (result.head, result.stem):
        print(f"kept in float: {len(part.nodes)} node(s), {part.reason}", file=out)
        for name, op in part.nodes.items():
            print(f"  {name} ({op})", file=out)
    if result.pixel_input:
        print(f"input: uint8 pixels (the input's quantisation is the x{contract.scale:.6g} normalisation)", file=out)
    elif pixel_scale(contract) is None:
        print(
            f"input: float32, as the original: its normalisation ({contract.describe()}) is more than a "
            "scale, so uint8 codes cannot be the pixels",
            file=out,
        )
    else:
        print("input: float32, as the original: the float stem reads it (--no-float-stem would take uint8 pixels)", file=out)


def run_quantize(args: argparse.Namespace, out: TextIO = sys.stdout) -> int:
    _check_args(args)
    original = load_model(
        ModelConfig(path=args.model, conf=MAP_CONF, iou=MAP_IOU, max_det=MAX_DET),
        RuntimeConfig(intra_op_threads=args.threads),
    )
    require_task(original, ("detect", "segment", "classify"), "quantize", "--model")  # before any work
    # What the comparison needs is checked now, not after minutes of quantising.
    if args.data is None:
        if args.eval_scenes and original.task != "classify":
            check_scene_classes(original, "compare on your own images with --data DIR, or skip it with --eval-scenes 0")
    elif original.task == "classify":
        image_files(args.data)
    else:
        check_labels(args.data, original.num_classes)
    inspect, conf = _inspection(args.config, args.camera)
    check_inspection(original, inspect, conf)
    calibration, frames = _calibration(args, original)
    done: list[tuple[Quantised, LoadedModel, int]] = []

    def write(tmp: Path) -> None:
        """Quantise into ``tmp``, and load it (its bytes hashed, its session made of them) and size it
        before it is moved to ``--out``: another run writing the same ``--out`` may replace it there
        meanwhile, and this run's report would describe that run's model. One that does not load is
        never moved there."""
        result = quantize(
            args.model,
            tmp,
            frames,
            method=args.method,
            exclude_head=args.exclude_head,
            float_stem=args.float_stem,
            reduce_range=args.reduce_range,
            pixel_input=pixel_scale(original.contract),
        )
        loaded = load_quantised(tmp, original, pixel_input=result.pixel_input, named=args.out)
        done.append((result, loaded, tmp.stat().st_size))

    write_with(args.out, write)
    result, quantised, size = done[0]
    print_result(result, original.contract, out)
    comparison = compare(
        {"fp32": original, "int8": quantised},
        latency_frames=args.latency_frames,
        eval_scenes=args.eval_scenes,
        eval_seed=args.eval_seed,
        data=args.data,
        inspect=inspect,
        conf=conf,
    )
    print(f"wrote {args.out} ({size / 1e6:.1f} MB, calibrated on {calibration})", file=out)
    print(format_comparison(comparison), file=out)
    if args.report is not None:
        document = report_document(args, original, quantised, result, calibration, comparison)
        write_whole(args.report, json.dumps(document, indent=2) + "\n")
    return 0
