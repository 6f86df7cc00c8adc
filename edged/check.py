"""``edged check``: everything `run` would refuse or fail on, found before the service starts.

It loads the model exactly as the daemon does (same contract checks, same head detection), opens every
camera through the capture thread the daemon uses, all at once as the daemon does and while the model
loads, and waits for their first frames (the size and rate each camera really gives, counted side by
side once the model is loaded, as the cameras will run), runs a grey frame of that size and the
camera's first frame through the real pipeline (NaN or infinite outputs there mean a broken model,
scores above 1 a wrong normalisation or head) and prints what that first frame gave, with its verdict:
the quickest way to see a wrong model or colour order. An image folder whose first image the model
cannot run on at its size (an ``inspect.roi`` outside it, a segmentation model's masks past their
budget), which run would skip, is checked with the first image that it can run on, saying how many run
would skip (exit 78 only where it can run on none, as for a camera). It warns (exit 0) where a
segmentation model's outlines can make a detections message larger than edged's subscribers take. It
creates and removes a file in each camera's evidence folder (refusing, as run does, two cameras whose
folders the drive takes for one: `edged.evidence.EvidenceOutput.shared`), a candidate's ``evidence_dir``,
the journal's folder and an OPC UA certificate's folder still to be made, sees that no other edged holds
the journal (with ``bind=False``, beside the running service that holds its own, none running another
configuration: `held_by_another`), binds and releases every address the daemon would listen on (each
output's, `edged.outputs.listening`; with ``bind=False``, beside a running daemon that holds them, one in
use is passed over) and requests and releases every reject line (`edged.reject`; with ``bind=False`` only
finds it: a chip or line that is not there is still refused), connects once to the MQTT broker when
``[mqtt]`` is set (refused, untrusted or absent is reported with its reason),
and prints what the engine says of itself (`InferenceEngine.report`: ONNX Runtime's providers and where
it placed each node, OpenVINO's device, plugin and precision). The last line is the one verdict:
``ok``, or the CLI's error naming the problem.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TextIO

import numpy as np

from edged.anomaly import Anomaly
from edged.capture import Capture
from edged.classify import Classes
from edged.config import DEFAULT_CONFIG_PATH, CandidateConfig, Settings
from edged.control import listening as control_socket
from edged.decode import Detections
from edged.errors import (
    BindError,
    ConfigError,
    ContractError,
    EdgedError,
    FolderError,
    ImageError,
    InferenceError,
    ModelError,
    SourceError,
)
from edged.evidence import EvidenceOutput, folder_problem
from edged.evidence import describe as describe_error
from edged.files import MadeFolders, lock_holders, nearest_folder, process_argv
from edged.geometry import BoxMap
from edged.heads.base import fmt_classes
from edged.journal import JournalOutput, lock_file, records
from edged.messages import MAX_PAYLOAD_BYTES
from edged.model import LoadedModel, load_model
from edged.mqtt import probe_broker
from edged.opcua import describe as describe_opcua
from edged.output import Endpoint
from edged.outputs import listening
from edged.pipeline import FramePath, FramePipeline, frame_path, roi_problem
from edged.preprocess import LETTERBOX_FILL
from edged.reject import check_lines
from edged.segment import Segmenter
from edged.settings.endpoints import ipc_path
from edged.settings.evidence import DEFAULT_NOTE
from edged.settings.inspect import InspectConfig
from edged.settings.numerals import INDEX_DIGITS, whole_number
from edged.settings.opcua import OpcuaConfig
from edged.settings.sources import FileSourceConfig, ImagesSourceConfig, SourceBase, mask_credentials
from edged.shadow import candidate_model_config, candidate_runtime, incomparable
from edged.sources.base import Frame
from edged.sources.images import frame_names, image_size, list_images, read_image
from edged.sources.registry import open_source
from edged.unit import Unit
from edged.verdict import AnomalyInspector, ClassInspector, Inspector

FIRST_FRAME_TIMEOUT_S = 30.0  # at least this long for a first frame; longer for a camera given longer to open
OPENING_MARGIN_S = 5.0  # past a camera's own open timeout (`SourceBase.opens_within_s`): its error comes first
SETTLE_S = 0.5  # a network stream first hands over the frames buffered while it opened, all at once
RATE_WINDOW_S = 1.0  # then frames are counted this long to measure the rate
TAKE_S = 0.05  # how long a probe waits for a frame before it looks whether it is to stop
FIRST_FRAME_SHOWN = 5  # detections of the first frame named, best first; the rest are counted
SIZES_READ = 10_000  # the headers read to find an image of a folder the model runs on, when its first does not
# A polygon point's bytes in a detections message as edged sends it, ``[x,y],`` with one decimal each:
# 17 at most, for a side of 10000 pixels or more (an image, up to `MAX_PIXELS`) and a 4-digit other
# side, ``[10000.5,3317.5],``; 16 for a 7680x4320 frame, 15 for 1280x720.
POINT_BYTES = 17
MIN_OUTLINE_POINTS = 8  # the least model.max_outline_points takes


@dataclass(frozen=True, slots=True)
class SourceProbe:
    """What the camera delivered: the frame size, the rate measured over `RATE_WINDOW_S`, the channel order
    its source declares (frames carry no order of their own to measure), and a copy of its first frame."""

    width: int
    height: int
    fps: float
    channel_order: str
    frame: np.ndarray
    name: str | None = None  # the file of an image folder's first frame


def describe_source(cfg: SourceBase) -> str:
    """The kind and its own keys, credentials masked: how a source is named to the operator."""
    keys = " ".join(f"{key}={value}" for key, value in cfg.model_dump().items() if key not in SourceBase.model_fields)
    return mask_credentials(f"{cfg.type} {keys}".strip())


def next_frame(capture: Capture, cfg: SourceBase, timeout_s: float, gave: str, stop: threading.Event | None = None) -> Frame:
    """Camera ``cfg``'s next frame from its started ``capture``; the capture's fatal error, or a
    ``SourceError`` saying it ``gave`` only that, when it is lost, ends or gives none for ``timeout_s``
    (or ``stop`` is set: nobody waits for it any more)."""
    deadline = time.monotonic() + timeout_s
    while (frame := capture.take(TAKE_S)) is None:
        if capture.fatal is not None:
            raise capture.fatal
        stats = capture.stats()
        if stats.state in ("lost", "ended") or time.monotonic() > deadline or (stop is not None and stop.is_set()):
            reason = stats.last_error or ("it ended" if stats.state == "ended" else f"none in {timeout_s:g} s")
            raise SourceError(f"camera {describe_source(cfg)} gave {gave}: {reason}")
    return frame


def probe_source(
    cfg: SourceBase,
    timeout_s: float = FIRST_FRAME_TIMEOUT_S,
    *,
    measure: threading.Event | None = None,
    stop: threading.Event | None = None,
) -> SourceProbe:
    """Open the camera as the daemon does and measure its first frames; ``SourceError`` with its reason
    when it cannot. The rate is counted once ``measure`` is set (at once without one); ``stop`` ends
    the probe early, its result unwanted."""
    stop = stop or threading.Event()
    capture = Capture(lambda: open_source(cfg), cfg.camera_id, decode_all=True)
    capture.start()
    try:
        frame = next_frame(capture, cfg, timeout_s, "no frame", stop)
        height, width, order, image = *frame.image.shape[:2], frame.channel_order, frame.image.copy()
        name = frame.source_file
        _take_for(capture, SETTLE_S, stop)
        while measure is not None and not measure.is_set() and not stop.is_set():
            capture.take(TAKE_S)  # as the daemon would: a camera that is not read may fall behind
        first = capture.stats().frames_captured
        elapsed = _take_for(capture, RATE_WINDOW_S, stop)
        return SourceProbe(width, height, (capture.stats().frames_captured - first) / elapsed, order, image, name)
    finally:
        capture.stop()


def first_frame_timeout_s(cfg: SourceBase) -> float:
    """How long check waits for camera ``cfg``'s first frame: `FIRST_FRAME_TIMEOUT_S`, or for a camera
    that may take longer to open, as long as `run` would wait, and then for its own error."""
    opens_within_s = cfg.opens_within_s
    return FIRST_FRAME_TIMEOUT_S if opens_within_s is None else max(FIRST_FRAME_TIMEOUT_S, opens_within_s + OPENING_MARGIN_S)


def _take_for(capture: Capture, seconds: float, stop: threading.Event) -> float:
    """Take frames as the daemon would for ``seconds``, or until ``stop``; the time it really took."""
    start = time.monotonic()
    while (elapsed := time.monotonic() - start) < seconds and not stop.is_set():
        capture.take(min(seconds - elapsed, TAKE_S))
    return elapsed


class _Probes:
    """Every camera probed at once (`probe_source`), as the daemon opens them, while the model loads:
    a camera's opening and first frame are waited for beside the others' and the model's loading,
    not after them, and the rates are counted side by side once the model is loaded (`measure`), as
    the cameras will run: cameras that share a bus deliver less together than alone. Leaving stops
    the probes still running (a model problem ends the check) and waits for them to close their cameras."""

    def __init__(self, sources: Sequence[SourceBase]) -> None:
        self._measure, self._stop = threading.Event(), threading.Event()
        self._pool = ThreadPoolExecutor(max_workers=len(sources), thread_name_prefix="edged-probe")
        probe = partial(probe_source, measure=self._measure, stop=self._stop)
        self._probes: dict[str, Future[SourceProbe]] = {
            cfg.camera_id: self._pool.submit(probe, cfg, first_frame_timeout_s(cfg)) for cfg in sources
        }

    def measure(self) -> None:
        """The model is loaded: count the cameras' rates now."""
        self._measure.set()

    def result(self, cfg: SourceBase) -> SourceProbe:
        """Camera ``cfg``'s probe, once it is done; its `SourceError` (or other error) raised here."""
        return self._probes[cfg.camera_id].result()

    def __enter__(self) -> _Probes:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._pool.shutdown(wait=True)


def _unloadable(e: EdgedError) -> ConfigError:
    return ConfigError(None, [f"model.candidate.path: the candidate does not load ({e}); the live model would go on alone"])


def _candidate(settings: Settings, live: LoadedModel, unit: Unit | None) -> str | None:
    """``[model.candidate]`` loaded as the daemon's trial loads it (`edged.shadow.Shadow`), so that one
    that would not load is found now, not as a log line while the live model goes on alone; its
    ``evidence_dir`` tried as `_evidence` tries a camera's (`FolderError`: the trial would save no frame)."""
    cfg = settings.model.candidate
    if cfg is None:
        return None
    try:
        model = load_model(candidate_model_config(settings.model, cfg), candidate_runtime(settings.runtime))
    except EdgedError as e:
        raise _unloadable(e) from None
    if (why := incomparable(live, model)) is not None:
        raise ConfigError(None, [f"model.candidate.path: {why}; the live model would go on alone"])
    try:
        for source in settings.source:
            frame_path(settings, model, source)
    except EdgedError as e:
        raise _unloadable(e) from None
    same = model.engine.identity.sha256 == live.engine.identity.sha256
    itself = ": the live model itself, the trial would compare it with itself" if same else ""
    return f"{model.engine.model_path} ({model.engine.identity.short}){itself}{_disagreements(settings, cfg, unit)}"


def _disagreements(settings: Settings, cfg: CandidateConfig, unit: Unit | None) -> str:
    """Where the frames the models disagree on go, once each camera's folder there has taken a file (and
    ``unit`` says the service could write there too); `FolderError` when not."""
    folder = cfg.evidence_dir
    if folder is None:
        return ""
    for source in settings.source:
        if (problem := folder_problem(folder, source.camera_id) or _unit_problem(unit, folder)) is not None:
            raise FolderError(
                f"model.candidate.evidence_dir: the frames the models disagree on cannot be saved in {folder}: "
                f"{problem}; the trial would save none"
            )
    return f"; the frames the models disagree on to {folder} (a file created and removed there)"


def _report(model: LoadedModel, out: TextIO) -> None:
    engine = model.engine
    outputs = ", ".join(f"{o.name} {list(o.shape)}" for o in engine.output_meta)
    labels = ", ".join(model.labels) if model.labels else "(no names: class ids only)"
    print(f"model      {engine.model_path} ({engine.identity.short})", file=out)
    if model.cfg.require_signature:
        print(f"signature  verified with {model.cfg.signature_key}", file=out)
    print(f"input      {model.contract.describe(order_source=True)}", file=out)
    print(f"output     {outputs} -> {model.head} head, {fmt_classes(model.num_classes)}: {labels}", file=out)
    if (warning := outline_warning(model)) is not None:
        print(f"{'':<10} warning: {warning}", file=out)
    for label, line in engine.report():
        print(f"{label:<10} {line}", file=out)


def outline_warning(model: LoadedModel) -> str | None:
    """Why a segmentation model's frame can make a detections message larger than edged's subscribers
    take (`MAX_PAYLOAD_BYTES`): the outlines of ``model.max_masks`` detections (at most ``max_det``) of
    ``model.max_outline_points`` points each, `POINT_BYTES` a point; None where it cannot. Run sends it
    all the same: a subscriber refuses it, which is found only there."""
    cfg = model.cfg
    if model.task != "segment":
        return None
    outlines, points = min(cfg.max_masks, cfg.max_det), cfg.max_outline_points
    most = outlines * points * POINT_BYTES
    if most <= MAX_PAYLOAD_BYTES:
        return None
    fixes = [f"model.max_masks to {MAX_PAYLOAD_BYTES // (points * POINT_BYTES)}"]
    if (fit := MAX_PAYLOAD_BYTES // (outlines * POINT_BYTES)) >= MIN_OUTLINE_POINTS:
        fixes.insert(0, f"model.max_outline_points to {fit}")
    return (
        f"a frame's detections message can reach {most / 1e6:.1f} MB, more than the {MAX_PAYLOAD_BYTES >> 20} MiB "
        f"edged's subscribers take: {outlines} outlines (model.max_masks = {cfg.max_masks}, model.max_det = "
        f"{cfg.max_det}) of up to {points} points (model.max_outline_points), {POINT_BYTES} bytes a point; "
        f"lower {' or '.join(fixes)}"
    )


class _RefusedAtSize(Exception):
    """The model cannot run on a frame of this size: ``inspect.roi`` does not fit in it, or a segmentation
    model's mask buffers would pass their budget. Run stops on such a camera with ``error`` (exit 78),
    and skips such an image of a folder as ``bad_frame_size`` (`edged.pipeline.FramePath`); ``why`` says
    it in one line, ``masks``: the segmenter that refused, to look at other sizes with."""

    def __init__(self, error: EdgedError, why: str, masks: Segmenter | None = None) -> None:
        super().__init__(why)
        self.error, self.why, self.masks = error, why, masks


def _first_run(plan: FramePipeline, what: str, image: np.ndarray) -> Detections | Classes | Anomaly:
    """Run ``image`` (named by ``what``) through the model; raise what the daemon would only count per
    frame, and `_RefusedAtSize` where the model cannot run at its size."""
    try:
        detections, _ = plan.process(image)
    except InferenceError as e:  # in the daemon one frame; here the model failing its first frame
        raise ModelError(f"the model fails on {what}: {e}") from None
    except ModelError as e:  # as `FramePath.run` takes it: this size cannot be planned
        raise _RefusedAtSize(e, str(e), plan.decoder if isinstance(plan.decoder, Segmenter) else None) from None
    if detections.nonfinite:
        raise ModelError(
            f"{what} gave {detections.nonfinite} NaN or infinite output value(s); a NaN score never passes "
            "the threshold, so edged would publish no detection at all: the model is broken, or overflows on "
            "this input (check an fp16 export, and model.scale, mean and std against how it was trained)"
        )
    if isinstance(detections, Detections) and detections.scores_above_one:
        # A probability never exceeds 1: on the first frames this can only be the set-up.
        raise ContractError(
            f"{what} gave {detections.scores_above_one} score(s) above 1; "
            "scores must be probabilities: check model.scale, mean and std against how the model was "
            "trained, and that its head ends in a sigmoid"
        )
    if isinstance(detections, Classes) and detections.scores_above_one:
        # Every frame of it would rank no class, and be uncertain: a classifier exported without its softmax.
        raise ContractError(
            f"{what} gave {detections.scores_above_one} class score(s) outside 0..1; a classifier's scores must "
            "be probabilities: export it with its softmax (ultralytics' -cls exports include it)"
        )
    if isinstance(detections, Anomaly) and detections.scores_above_one:
        # anomalib's export normalises the score and map to 0..1 (0.5 its threshold); run would drop every such frame.
        given = (
            f"the anomaly score {detections.score:g}"
            if not 0.0 <= detections.score <= 1.0
            else f"{detections.scores_above_one} anomaly map value(s)"
        )
        raise ContractError(
            f"{what} gave {given}, outside 0..1: an anomalib export "
            "normalises its score and map (0.5 the threshold it was trained with), so this one was exported "
            "without anomalib's post-processing, or is no anomalib model; re-export it with anomalib"
        )
    return detections


def _first_frame(
    model: LoadedModel,
    path: FramePath,
    detections: Detections | Classes | Anomaly,
    width: int,
    height: int,
    what: str = "first frame",
) -> str:
    """What the camera's first frame (``what``) gave, as `run` would publish it: its detections (a
    classifier's best classes, an anomaly model's score and regions), best first, and its verdict."""
    verdict = ""
    if isinstance(detections, Classes):
        if isinstance(path.inspector, ClassInspector):
            verdict = f"; verdict {path.inspector(detections).verdict}"
        top = ", ".join(
            f"{model.label(c)} {score:.2f}"
            for c, score in zip(detections.class_ids.tolist(), detections.scores.tolist(), strict=True)
        )
        return f"{what}: classes {top or 'none'}{verdict}"
    if isinstance(detections, Anomaly):
        if isinstance(path.inspector, AnomalyInspector):
            verdict = f"; verdict {path.inspector(detections, width, height).verdict}"
        state = "anomalous" if detections.anomalous else "normal"
        return (
            f"{what}: anomaly score {detections.score:.4f} ({state}, threshold {detections.threshold:g}), "
            f"{detections.scores.shape[0]} region(s){verdict}"
        )
    if isinstance(path.inspector, Inspector):
        inspected = path.inspector(detections, width, height)
        detections, verdict = inspected.detections, f"; verdict {inspected.verdict}"
    found = [
        f"{model.label(c)} {score:.2f}"
        for c, score in zip(detections.class_ids.tolist(), detections.scores.tolist(), strict=True)
    ]
    shown = ", ".join(found[:FIRST_FRAME_SHOWN]) + (
        f", and {len(found) - FIRST_FRAME_SHOWN} more" if len(found) > FIRST_FRAME_SHOWN else ""
    )
    return f"{what}: {len(found)} detection(s){': ' + shown if found else ''}{verdict}"


def _class(model: LoadedModel, key: str) -> str:
    """A class as ``[inspect]`` names it, with its label where it is named by its id (``"4 (crack)"``)."""
    index = whole_number(key, INDEX_DIGITS)
    if key in model.labels or index is None or index >= len(model.labels):
        return key
    return f"{key} ({model.labels[index]})"


def _inspection(model: LoadedModel, inspect: InspectConfig | None) -> str:
    """A camera's inspection in one line, in the terms of the model's task: thresholds, zones or
    region, NG classes (an anomaly model's one threshold, a classifier's ``min_confidence``)."""
    if inspect is None:
        return "inspect: none (no verdict; every detection is published)"
    if model.task == "anomaly":
        given = model.cfg.anomaly_threshold
        threshold = f"model.anomaly_threshold {given:g}" if given is not None else "the export's"
        zones = (
            f"zones {', '.join(inspect.zones)} (regions outside them count for nothing)" if inspect.zones else "whole frame"
        )
        return f"inspect: anomaly score above {threshold}; {zones}"
    thresholds = ", ".join(
        [f"model.conf {model.cfg.conf:g}", *(f"{_class(model, name)} {t:g}" for name, t in inspect.class_conf.items())]
    )
    ng = ", ".join(_class(model, name) for name in inspect.ng_classes) if inspect.ng_classes is not None else "every class"
    if model.task == "classify":
        region = f"region {list(inspect.roi)}" if inspect.roi is not None else "whole frame"
        doubt = f"; uncertain below {inspect.min_confidence:g}" if inspect.min_confidence is not None else ""
        return f"inspect: thresholds {thresholds}; {region}; NG classes: {ng}{doubt}"
    zones = f"zones {', '.join(inspect.zones)} (outside them: {inspect.outside_zones})" if inspect.zones else "whole frame"
    return f"inspect: thresholds {thresholds}; {zones}; NG classes: {ng}"


def _evidence(settings: Settings, cfg: SourceBase, unit: Unit | None) -> str:
    """Where a camera's evidence goes, after creating and removing a file there (and asking ``unit``,
    the service's, whether it could too); `FolderError` when it cannot."""
    evidence = settings.evidence_for(cfg)
    if evidence is None:
        return "evidence: none saved"
    default = settings.evidence_dir_default(cfg)
    problem = folder_problem(evidence.dir, cfg.camera_id) or _unit_problem(unit, evidence.dir)
    if problem is not None:
        advice = f"; {DEFAULT_NOTE}" if default else ""
        raise FolderError(
            f"evidence.dir: camera {cfg.camera_id}'s evidence cannot be saved in {evidence.dir}: {problem}{advice}"
        )
    where = f"{evidence.dir / cfg.camera_id}{' (the default: evidence.dir is not set)' if default else ''}"
    return f"evidence: {evidence.save} frames to {where} (a file created and removed there)"


def _check_source(
    settings: Settings,
    model: LoadedModel,
    cfg: SourceBase,
    probed: Callable[[], SourceProbe],
    named: bool,
    out: TextIO,
    unit: Unit | None,
) -> SourceError | None:
    """Run one camera's frames (``probed()``) through the model and say what it will do; the camera's
    error, if it gave no frame."""
    path = frame_path(settings, model, cfg)  # [inspect] names classes the model must have
    name = f"{cfg.camera_id}: " if named else ""
    try:
        probe = probed()
    except SourceError as e:
        if not named:
            raise
        print(f"source     {name}{describe_source(cfg)}", file=out)
        print(f"           {e}", file=out)
        return e
    print(f"source     {name}{describe_source(cfg)}", file=out)
    rate = _unpaced(cfg) or f"at {probe.fps:.1f} fps (measured)"
    print(
        f"           delivers {probe.width}x{probe.height} {rate}, "
        f"channel order {probe.channel_order} (declared: source.channel_order)",
        file=out,
    )
    first = f"the first frame of camera {cfg.camera_id}" if named else "the camera's first frame"
    image, what = probe.frame, "first frame"
    try:
        detections = _first_frames(model, path, cfg, image, first, named)
    except _RefusedAtSize as refused:
        # A camera's every frame is this size; an image folder's others may not be (run skips this one).
        if not isinstance(cfg, ImagesSourceConfig):
            raise refused.error from None
        fitting = _fitting_image(cfg, _runs_at(model, path.roi, refused.masks))
        if fitting is None:
            raise refused.error from None
        print(f"           {fitting.said(cfg, probe.name, refused.why)}", file=out)
        image, what = fitting.image, f"first image that fits ({fitting.name})"
        try:
            detections = _first_frames(model, path, cfg, image, fitting.name, named)
        except _RefusedAtSize as again:
            raise again.error from None
    height, width = image.shape[:2]
    print(f"           {_first_frame(model, path, detections, width, height, what)}", file=out)
    print(f"           {_inspection(model, settings.inspection(cfg))}", file=out)
    mode = settings.trigger_mode(cfg)
    trigger = "request: one frame per request on trigger.endpoint" if mode == "request" else "free: every frame"
    print(f"           trigger: {trigger}", file=out)
    print(f"           {_evidence(settings, cfg, unit)}", file=out)
    return None


def _unpaced(cfg: SourceBase) -> str | None:
    """How a source with no rate of its own delivers (each frame once the model has taken the one before),
    or None: what check measured of such a source is how fast it took one frame, 0.0 fps."""
    if isinstance(cfg, ImagesSourceConfig) and not cfg.pace:
        return "unpaced (pace = false: each image as the model takes it)"
    if isinstance(cfg, FileSourceConfig) and not cfg.realtime:
        return "unpaced (realtime = false: each frame as the model takes it)"
    return None


def _first_frames(
    model: LoadedModel, path: FramePath, cfg: SourceBase, image: np.ndarray, what: str, named: bool
) -> Detections | Classes | Anomaly:
    """A plain grey frame of ``image``'s size, then ``image`` (named by ``what``), through a plan for that
    size: what ``image`` gave; `_RefusedAtSize` where the model cannot run at that size."""
    height, width = image.shape[:2]
    # The region run classifies: one that does not fit would have every frame of this size rejected.
    if (problem := roi_problem(path.roi, width, height)) is not None:
        error = ConfigError(None, [f"{problem} (camera {cfg.camera_id})" if named else problem])
        raise _RefusedAtSize(error, problem)
    thresholds = path.inspector.thresholds if path.inspector is not None else None
    plan = FramePipeline(model, width, height, cfg.channel_order, thresholds, roi=path.roi)
    _first_run(plan, "a plain grey frame", np.full((height, width, 3), LETTERBOX_FILL, np.uint8))
    return _first_run(plan, what, image)


def _runs_at(
    model: LoadedModel, roi: tuple[int, int, int, int] | None, masks: Segmenter | None
) -> Callable[[int, int], bool]:
    """Whether the model runs on a frame of a width and height, as run finds it (`_RefusedAtSize`):
    ``roi`` fits in it, and a segmentation model's mask buffers (``masks``) are within their budget."""
    contract = model.contract

    def runs(width: int, height: int) -> bool:
        if roi_problem(roi, width, height) is not None:
            return False
        if masks is None:
            return True
        return masks.budget_problem(BoxMap.letterbox(width, height, contract.width, contract.height)) is None

    return runs


@dataclass(frozen=True, slots=True)
class _Fitting:
    """An image folder's first image the model runs on (`_fitting_image`), decoded, and of the ``looked``
    first of its ``total`` images, how many run would skip for their size (``skipped``)."""

    name: str
    image: np.ndarray
    skipped: int
    looked: int
    total: int

    def said(self, cfg: ImagesSourceConfig, first: str | None, why: str) -> str:
        """One line: how many images run would skip, the ``first`` of them (the folder's first) and ``why``."""
        among = f"{self.total}" if self.looked == self.total else f"first {self.looked} of the {self.total}"
        return (
            f"run would skip {self.skipped} of the {among} images at {cfg.path} for their size (bad_frame_size), "
            f"the first {first or 'one'}: {why}"
        )


def _fitting_image(cfg: ImagesSourceConfig, runs: Callable[[int, int], bool]) -> _Fitting | None:
    """The first image of ``cfg``'s folder, in the order the images source reads them, that the model
    ``runs`` on at its size, decoded; None when none does. Sizes come from the headers of its first
    `SIZES_READ` images (`edged.sources.images.image_size`), and only the image chosen is decoded (one that does not
    decode is passed over, as the source skips it)."""
    paths = list_images(cfg.path)
    looked = paths[:SIZES_READ]
    known: dict[tuple[int, int], bool] = {}
    fitting: list[str] = []
    skipped = 0
    for at in looked:
        if (size := image_size(at)) is None:
            continue  # the source skips it as unreadable, not for its size
        if size not in known:
            known[size] = runs(*size)
        if known[size]:
            fitting.append(at)
        else:
            skipped += 1
    for at, name in zip(fitting, frame_names(cfg.path, fitting), strict=True):
        try:
            image = read_image(at)
        except ImageError:
            continue
        if not runs(image.shape[1], image.shape[0]):  # OpenCV turns a PNG, TIFF or WebP by its orientation tag
            skipped += 1
            continue
        return _Fitting(name, image, skipped, len(looked), len(paths))
    return None


def _takes_no_file(folder: Path) -> str | None:
    """Why ``folder`` (where it is still to be made, the nearest folder above it) takes no file, found by
    writing a page to a file there and removing it; None when it does."""
    try:
        with tempfile.NamedTemporaryFile(dir=nearest_folder(folder), prefix=".edged-check-") as probe:
            probe.write(bytes(4096))
            probe.flush()
    except OSError as e:
        return describe_error(e)
    return None


def _unit_problem(unit: Unit | None, folder: Path) -> str | None:
    """Why the service that runs this configuration could not write in ``folder`` (`edged.unit`); None
    where it could, or where no such service is known (not run as root for a packaged unit)."""
    return unit.cannot_write(folder) if unit is not None else None


def _journal(settings: Settings, config_path: Path | None, bind: bool, unit: Unit | None) -> str:
    """Where the verdict journal goes and what it will record, once its folder has taken a file (`FolderError`
    when not: run would serve and record nothing) and no other edged holds it (`ConfigError`, as run refuses
    to start). Without ``bind``, beside the running service, which holds its own, a journal held by an `edged
    run` of ``config_path`` passes (`held_by_another`)."""
    journal = settings.journal
    if not journal.enabled:
        return "off ([journal] enabled = false)"
    inspected = settings.inspected()
    what = f"the verdicts of {', '.join(inspected)}" if inspected else "no verdicts (no camera has [inspect])"
    if journal.detections:
        what += ", and every detections message sent"
    if records(settings):
        if (problem := _takes_no_file(journal.file.parent) or _unit_problem(unit, journal.file.parent)) is not None:
            raise FolderError(f"journal.path: {journal.file} cannot be written: {problem}; run would record no verdict")
        if (problem := JournalOutput.in_use(settings, create=False)) is not None:
            if bind or (problem := held_by_another(journal.file, config_path)) is not None:
                raise ConfigError(None, [problem])
    return f"{journal.path}: {what}; durability {journal.durability}"


def held_by_another(journal: Path, config_path: Path | None) -> str | None:
    """Why journal ``journal``, whose lock is held, is another edged's: a process running `edged run` on another
    configuration holds it (`edged.files.lock_holders`). None where the holder runs ``config_path``: the
    running service, whose journal it is; or where it cannot be told (the holder's command line and working
    folder unreadable): perhaps the service, as a port in use is passed over."""
    for pid in lock_holders(lock_file(journal)):
        theirs = _run_config(pid)
        if theirs is None or config_path is None or (same := _same_config(pid, theirs, config_path)) is None:
            continue
        if same:
            return None
        return (
            f"journal.path {journal} is held by another edged (process {pid}, running {theirs}): give each edged "
            "a journal.path of its own"
        )
    return None


def _same_config(pid: int, theirs: Path, config_path: Path) -> bool | None:
    """Whether process ``pid``'s configuration ``theirs`` is ``config_path``: looked up from its root
    first (its mounts, a container's or ``BindPaths=``, may not be check's), then from check's; None
    where neither can be looked at."""
    for seen in (Path(f"/proc/{pid}/root{theirs}"), theirs):  # ``theirs`` is absolute (`_run_config`)
        with contextlib.suppress(OSError):
            return os.path.samefile(seen, config_path)
    return None


def _run_config(pid: int) -> Path | None:
    """The configuration process ``pid``'s `edged run` reads (its ``--config`` or ``-c``, from its working
    folder; else the default); None where it runs none or cannot be looked at."""
    try:
        folder = os.readlink(f"/proc/{pid}/cwd")
    except OSError:
        return None
    argv = process_argv(pid)
    if argv is None or "run" not in argv:
        return None
    parser = argparse.ArgumentParser(add_help=False, exit_on_error=False)  # as run's reads it: `--conf X`, `-cX`
    parser.add_argument("--config", "-c", type=Path, default=DEFAULT_CONFIG_PATH)
    try:
        config = parser.parse_known_args(argv[argv.index("run") + 1 :])[0].config
    except argparse.ArgumentError:
        return None
    return Path(folder, config)


def _opcua(cfg: OpcuaConfig, settings: Settings, unit: Unit | None) -> str:
    """What the OPC UA server will serve (`edged.opcua.describe`), once the folder its certificate is to be
    made in has taken a file: run would serve every other output without it, retrying (`FolderError`)."""
    from edged.opcua_server import CERT_FILE

    said = describe_opcua(cfg, settings)
    if cfg.users_file is not None and not (cfg.cert_dir / CERT_FILE).is_file():
        if (problem := _takes_no_file(cfg.cert_dir) or _unit_problem(unit, cfg.cert_dir)) is not None:
            raise FolderError(
                f"opcua.cert_dir: the server certificate cannot be made in {cfg.cert_dir}: {problem}; "
                "run would serve no OPC UA"
            )
    return said


def _bind_all(settings: Settings, bind: bool, unit: Unit | None, out: TextIO) -> None:
    """Bind every address the daemon would listen on, all at once as it holds them, then release them; an
    ipc:// socket's folder is also tried as the service would make its socket there (`_unit_problem`).
    With ``bind=False``, beside the running daemon, an address another program holds is passed over as
    perhaps the daemon's own; one that cannot be bound otherwise (not this board's, a name that resolves
    to none, another of the configuration's own) still fails, as `run` would."""
    with contextlib.ExitStack() as bound:
        held: list[Endpoint] = []
        for endpoint in [*listening(settings), *control_socket(settings)]:
            path = ipc_path(endpoint.address)
            if path is not None and (problem := _unit_problem(unit, path.parent)) is not None:
                raise BindError(f"{endpoint.key}: the service cannot make its socket {path}: {problem}")
            tried = "bound and released" if bind else "bound and released; --no-bind"
            try:
                bound.callback(endpoint.bind())
                held.append(endpoint)
            except BindError as e:
                if bind or not e.in_use or not _held_elsewhere(endpoint, bound, held):
                    advice = "; if the running edged service holds it, `edged check --no-bind` checks the rest"
                    raise type(e)(f"{e}{advice if bind else ''}") from None
                tried = "in use, by the running service perhaps: --no-bind"
            print(f"listen     {endpoint.key}: {endpoint.address} ({tried})", file=out)


def _held_elsewhere(endpoint: Endpoint, bound: contextlib.ExitStack, held: list[Endpoint]) -> bool:
    """Whether ``endpoint``, found in use, is held by another program rather than by one of the ``held``
    addresses this check bound before it (``bound`` releases them): tried alone, then those bound again."""
    bound.close()
    try:
        endpoint.bind()()
    except BindError as alone:
        if not alone.in_use:
            raise
        return True
    finally:
        for earlier in held:
            bound.callback(earlier.bind())
    return False


def _reject_lines(settings: Settings, bind: bool, out: TextIO) -> None:
    """Find every reject line, and request it once and release it (`edged.reject.check_lines`); only
    find it with ``bind=False``, beside a running daemon that holds them."""
    for said in check_lines(settings, request=bind):
        print(f"reject     {said}", file=out)


def run_check(
    config_path: Path | None, settings: Settings, unit: Unit | None, out: TextIO = sys.stdout, *, bind: bool = True
) -> int:
    """Every camera is opened and tried, so that one missing camera does not hide another's
    problem; a model or contract problem stops at once (exit 78). ``unit``: the service that runs the
    configuration, as whose user and in whose sandbox each folder is tried (`edged.unit.Unit.checked_as`).
    ``bind``: bind and release every listening address (off beside a running daemon, which holds them)."""
    print(f"config     {config_path}", file=out)
    if unit is not None:
        user = f"as user {unit.user}" if unit.user else "as root"
        sandbox = ", in its sandbox" if unit.writable is not None else ""
        print(f"service    {unit.name}: each folder tried {user}{sandbox}, as it runs", file=out)
    try:
        with _Probes(settings.source) as probes:
            model = load_model(settings.model, settings.runtime, record_placement=True, lanes=settings.lanes())
            probes.measure()
            named = len(settings.source) > 1
            failed = [
                (cfg.camera_id, e)
                for cfg in settings.source
                if (e := _check_source(settings, model, cfg, partial(probes.result, cfg), named, out, unit)) is not None
            ]
            with MadeFolders() as made:  # tried, and removed again
                problem = EvidenceOutput.shared(settings, made)
            if problem is not None:
                raise ConfigError(None, [problem])
        candidate = _candidate(settings, model, unit)
    except ConfigError as e:  # found with the model or a camera: named like the configuration's own problems
        raise ConfigError(e.path or config_path, e.problems) from None
    try:
        journal = _journal(settings, config_path, bind, unit)
    except ConfigError as e:
        raise ConfigError(config_path, e.problems) from None
    _bind_all(settings, bind, unit, out)
    _reject_lines(settings, bind, out)
    print(f"journal    {journal}", file=out)
    if settings.mqtt is not None:
        print(f"mqtt       {probe_broker(settings.mqtt, settings.source[0].camera_id)}", file=out)
    if settings.opcua is not None:
        print(f"opcua      {_opcua(settings.opcua, settings, unit)}", file=out)
    _report(model, out)
    if candidate is not None:
        print(f"candidate  {candidate}", file=out)
    if failed:
        names = ", ".join(name for name, _ in failed)
        raise SourceError(f"{len(failed)} of {len(settings.source)} cameras gave no frame ({names}): {failed[0][1]}")
    print("ok", file=out)
    return 0
