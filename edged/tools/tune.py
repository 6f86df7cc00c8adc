"""``edged tune``: which engine and precision to run on this board, chosen by measuring them here.

Each engine x precision the machine offers (ONNX Runtime f32 and int8; OpenVINO f32, bf16, f16 and
int8, those the device lacks said and skipped) runs the daemon's own per-frame path, the one
``edged bench`` times (`edged.tools.bench_rows.FullPath`: preprocess, inference, decode, the
message serialised and sent), over the user's images, one variant after the other. Each is timed
(latency p50 and p99, process CPU per frame, resident memory after it) and judged against the FP32
model on ONNX Runtime (`edged.tools.agreement`: mAP of its boxes against FP32's, and OK/NG verdicts
under the configuration's ``[inspect]``), or against labels when given. The gate (by default at most
one point of mAP@0.5 lost and no verdict flipped) decides which may be chosen; the fastest that
passes is written as a ``[model]`` snippet. The INT8 model is `edged quantize`'s unless one is given,
calibrated on every other image by name and every variant's accuracy judged on the others only: a
model judged on the images its activation ranges were fitted to looks better than it will on the
line. Nothing running is touched: tune reads the configuration only.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from edged.config import EngineName, ModelConfig, Precision, Settings, load_config
from edged.engines import is_quantised
from edged.errors import ConfigError, ContractError, DataError, ModelError, SetupError, UsageError
from edged.files import refuse_overwriting, write_whole, write_with
from edged.model import LoadedModel, load_model, require_task
from edged.settings.inspect import InspectConfig
from edged.tools import bench_rows as rows
from edged.tools.agreement import RANK_CONF, Flip, agreement, camera_inspection, check_inspection
from edged.tools.bench import machine_info, rss_kb
from edged.tools.calibrate import decoded
from edged.tools.evaluate import EvalSample, check_scene_classes, evaluate, image_files, read_yolo_labels, scene_samples

VARIANTS: tuple[tuple[EngineName, Precision], ...] = (
    ("onnxruntime", "f32"),
    ("onnxruntime", "int8"),
    ("openvino", "f32"),
    ("openvino", "bf16"),
    ("openvino", "f16"),
    ("openvino", "int8"),
)
REFERENCE = VARIANTS[0]
SCENE_SIZE = (1280, 720)
SCENE_SEED = 0  # held out: `edged quantize` calibrates on seed 1 by default
CALIB_SEED = 1
REPORT_CONF = 0.25  # precision and recall against labels, as `edged eval`
# The images tune holds at once, each run by every variant: 1 GiB, some 380 frames of 1280x720.
# --max-images of a folder of camera frames held them all, gigabytes on a board of 4.
HELD_BYTES = 1 << 30
# The fewest images tune splits into calibration and judged halves: each half at least `edged quantize`'s
# FEW_CALIBRATION_FRAMES (8), below which calibration is warned of. Fewer calibrate and judge together.
SPLIT_MIN = 16


@dataclass(frozen=True, slots=True)
class Gate:
    """What a variant may lose against the reference and still be chosen."""

    max_map_drop: float  # points of mAP@0.5
    max_flips: int  # images whose OK/NG verdict differs


@dataclass(frozen=True, slots=True)
class Split:
    """The images every variant's accuracy is judged on, and those the INT8 model tune makes is
    calibrated on: judged on its own calibration images, it looks better than it will on the line."""

    judged: list[EvalSample]
    calibration: list[EvalSample] | None  # None: generated scenes of CALIB_SEED, or no calibration here
    held_out: bool | None  # whether no judged image calibrated; None where tune calibrates nothing
    calibrated: list[str] = field(default_factory=list)  # the names calibration was handed, as it ran


def _split(samples: list[EvalSample], quantising: bool, scenes: bool) -> Split:
    """Every other image by sorted name calibrates (the first of each pair) and the rest judge, so
    that both halves span the folder, and a rerun splits it alike; all judge where tune does not
    quantise, on generated scenes (calibrated on scenes of another seed) and below `SPLIT_MIN`."""
    if not quantising:
        return Split(samples, None, None)
    if scenes:
        return Split(samples, None, True)
    if len(samples) < SPLIT_MIN:
        return Split(samples, samples, False)
    return Split(samples[1::2], samples[0::2], True)


def _judged_on(split: Split, data: str) -> str:
    """Which images the accuracy was judged on, as the report says it."""
    if split.held_out is None:
        return f"all {data}: tune calibrated no INT8 model"
    if split.calibration is None:
        return f"the {data}; the INT8 model calibrated on {len(split.calibrated)} others, seed {CALIB_SEED}"
    if split.held_out:
        return (
            f"{len(split.judged)} of the {data}, every other one by name; the other {len(split.calibrated)} "
            "calibrated the INT8 model"
        )
    return (
        f"the {data}, the very ones the INT8 model calibrated on: too few to hold some out ({SPLIT_MIN} or more "
        "are split), so its rows look better than they will on new parts"
    )


def _noted(frames: Iterator[EvalSample], names: list[str]) -> Iterator[EvalSample]:
    """``frames``, each one's name added to ``names`` as calibration takes it."""
    for frame in frames:
        names.append(frame.name)
        yield frame


def _images(
    folder: Path | None, labels: Path | None, limit: int, num_classes: int, log: TextIO
) -> tuple[str, list[EvalSample]]:
    """The frames tune runs on, in memory (each is run by every variant), with labels from ``labels``
    (``DIR/NAME.txt`` per image, its path under the image folder kept) when given; no more than
    `HELD_BYTES` of them, those past it left out and said."""
    if folder is None:
        total, samples = scene_samples(limit, SCENE_SEED, *SCENE_SIZE)
        what = f"generated scenes, seed {SCENE_SEED}"
    else:
        paths = image_files(folder)[:limit]
        names = [path.relative_to(folder) for path in paths]
        label_files = [(labels / name).with_suffix(".txt") for name in names] if labels is not None else []
        if labels is not None and not any(file.exists() for file in label_files):
            raise DataError(
                f"--labels {labels} labels none of the {len(paths)} image(s) under {folder} (the first would be "
                f"{label_files[0]}): give the folder that holds a NAME.txt per image"
            )
        total, samples = len(paths), _read(paths, names, label_files, num_classes)
        what = f"images under {folder}"
    held: list[EvalSample] = []
    size = 0
    for sample in samples:  # decoded one at a time: those past the budget never are
        size += sample.image.nbytes
        if held and size > HELD_BYTES:
            print(
                f"warning: tune holds the images it runs in memory, and the first {len(held)} of {total} fill "
                f"{HELD_BYTES >> 20} MiB: the other {total - len(held)} are left out (--max-images {len(held)})",
                file=log,
            )
            break
        held.append(sample)
    return f"{len(held)} {what}", held


def _read(paths: list[Path], names: list[Path], label_files: list[Path], num_classes: int) -> Iterator[EvalSample]:
    """Each image decoded, with its labels from ``label_files`` where given, when its turn comes."""
    for i, (path, name) in enumerate(zip(paths, names, strict=True)):
        image = decoded(path)
        boxes, classes = np.zeros((0, 4), np.float32), np.zeros(0, np.int64)
        if label_files:
            h, w = image.shape[:2]
            boxes, classes = read_yolo_labels(label_files[i], w, h, num_classes)
        yield EvalSample(str(name), image, boxes, classes)


def _int8_model(
    args: argparse.Namespace,
    settings: Settings,
    reference: LoadedModel,
    split: Split,
    made: Path | None,
    log: TextIO,
) -> Path:
    """The INT8 model: ``--int8`` as given, else `edged quantize`'s written to ``made``, calibrated on
    ``split``'s calibration images (or training-seed scenes)."""
    if args.int8 is not None:
        # One that onnxruntime cannot run as INT8 is a wrong path or file: said now, with exit 78, not
        # as two skipped rows once every other variant has been timed.
        try:
            given = load_model(_variant_config(settings, "onnxruntime", "int8", args.int8), settings.runtime)
        except (ModelError, ContractError) as e:
            # A float model, in tune's words: the engine's refusal advises a model.precision tune set.
            if isinstance(e, ContractError) and not is_quantised(args.int8):
                raise ModelError(
                    f"--int8 {args.int8}: the model is not quantised (no QuantizeLinear or QLinear operator): "
                    f"give the INT8 model `edged quantize` made from model.path {settings.model.path}"
                ) from None
            raise ModelError(f"--int8 {args.int8}: {e}") from None
        # Another model's INT8 copy (the segmentation model's, for a detector) ran, was judged and could be chosen.
        for what, ours, theirs in zip(INTERFACE, _interface(reference), _interface(given), strict=True):
            if ours != theirs:
                raise ModelError(
                    f"--int8 {args.int8} is not an INT8 copy of model.path {settings.model.path}: its {what} "
                    f"{theirs} against {ours}; give the model `edged quantize` made from {settings.model.path}"
                )
        return Path(args.int8)
    from edged.tools import quantize as q  # the onnx package: only when tune quantises

    assert made is not None  # `run_tune` names it whenever tune quantises
    if split.calibration is not None:
        total, frames = len(split.calibration), iter(split.calibration)
    else:
        total, frames = scene_samples(len(split.judged), CALIB_SEED, *SCENE_SIZE)
    held = (
        f", the other {len(split.judged)} held out to judge accuracy"
        if split.calibration is not None and split.held_out
        else ""
    )
    print(f"quantising {settings.model.path} to {made}, calibrated on {total} frames{held} ...", file=log)
    if warning := q.few_frames(total):
        print(warning, file=log)
    if not split.held_out:
        print(
            f"warning: {total} image(s) are too few to calibrate the INT8 model on some and judge it on others "
            f"(tune splits {SPLIT_MIN} or more, every other one by name): its accuracy is judged on the images "
            "it was calibrated on and looks better than it will on new parts; give more images (--max-images) "
            "or an --int8 model calibrated on others",
            file=log,
        )
    calibration = q.CalibrationFrames(reference.contract, _noted(frames, split.calibrated), total, log)
    write_with(
        made, lambda tmp: q.quantize(settings.model.path, tmp, calibration, pixel_input=q.pixel_scale(reference.contract))
    )
    return made


INTERFACE = ("task", "classes", "input shapes", "outputs")


def _interface(model: LoadedModel) -> tuple[object, ...]:
    """What an INT8 copy keeps of its FP32 model, one entry per name in `INTERFACE` (its input may
    take uint8 pixels: only shapes are compared)."""
    engine = model.engine
    return (
        model.task,
        list(model.class_names),
        [list(i.shape) for i in engine.input_meta],
        [(o.name, list(o.shape)) for o in engine.output_meta],
    )


def _unused(folder: Path, stem: str) -> Path:
    """``folder/stem.onnx``, or ``stem.2.onnx`` and on where that is taken: a model there (signed,
    calibrated on other images) is someone's, and stays. The name is claimed by creating the file,
    empty until the model replaces it, so that a second tune on the same folder at once takes the
    next name instead of removing this one's model. Tune removes its own unless it is chosen."""
    path, n = folder / f"{stem}.onnx", 1
    while True:
        try:
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
        except FileExistsError:
            n += 1
            path = folder / f"{stem}.{n}.onnx"
        else:
            return path


def _cache_folder(folder: Path) -> Path:
    """``folder``, made now if need be, and writable: found out before the work, not after it."""
    where = f"{folder}, where tune writes the INT8 model it makes (--cache-dir, else runtime.cache_dir),"
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(f"{where} cannot be made: {e.strerror or e}") from None
    if not os.access(folder, os.W_OK | os.X_OK):
        raise UsageError(f"{where} cannot be written by this user")
    return folder


def _variant_config(settings: Settings, engine: EngineName, precision: Precision, int8: Path | None) -> ModelConfig:
    path = int8 if precision == "int8" and int8 is not None else settings.model.path
    return settings.model.model_copy(update={"engine": engine, "precision": precision, "path": path, "candidate": None})


def _timing(model: LoadedModel, samples: list[EvalSample], frames: int, warmup: int) -> dict[str, float]:
    """Latency p50/p99 and CPU per frame of the daemon's full path, cycling through the images of the
    first image's size: the path is planned for one frame size, as a camera gives."""
    cycle = itertools.count()
    timed = [s.image for s in samples if s.image.shape == samples[0].image.shape]
    with rows.FullPath(model, timed[0]) as full:

        def row() -> rows.TimedFrame:
            full.image = timed[next(cycle) % len(timed)]
            return full()

        for _ in range(warmup):
            row()
        times = rows.timing([row().total_ms for _ in range(frames)])
        cpu = rows.cpu_per_frame(row, max(10, frames // 3), 0)
    return {"p50_ms": times["median_ms"], "p99_ms": times["p99_ms"], "cpu_ms_per_frame": cpu["cpu_ms_per_frame"]}


def _variant(
    settings: Settings,
    cfg: ModelConfig,
    reference: LoadedModel,
    samples: list[EvalSample],
    judged: list[EvalSample],
    labelled: bool,
    inspect: InspectConfig | None,
    args: argparse.Namespace,
) -> dict[str, Any]:
    """One engine x precision: its timing on ``samples`` on the configured thresholds, its accuracy on
    ``judged`` ranked at RANK_CONF and its verdicts under ``inspect`` (the camera's, `camera_inspection`)."""
    timed = load_model(cfg, settings.runtime)
    # Absolute: the snippet is merged into a configuration, which reads paths relative to its own folder.
    row: dict[str, Any] = {"engine": cfg.engine, "precision": cfg.precision, "path": str(cfg.path.resolve())}
    row.update(_timing(timed, samples, args.frames, args.warmup))
    row["rss_mb"] = rss_kb() / 1024
    ranked = load_model(cfg.model_copy(update={"conf": RANK_CONF}), settings.runtime)
    agreed = agreement(reference, ranked, iter(judged), inspect=inspect, conf=settings.model.conf)
    row["agreement"] = agreed.to_dict()
    row["map50"] = agreed.map50
    if labelled:
        row["labels"] = evaluate(ranked, iter(judged), len(judged), REPORT_CONF).to_dict()
        row["map50"] = row["labels"]["map50"]
    return row


def _judge(rows_: list[dict[str, Any]], gate: Gate, inspecting: bool) -> dict[str, Any] | None:
    """Mark each row passed or not against the reference row (the first); the fastest passing row."""
    base = rows_[0]["map50"]
    for row in rows_:
        drop = 100 * (base - row["map50"])
        flips = len(row["agreement"]["verdicts_flipped"]) if inspecting else 0
        row["map50_drop_points"] = drop
        row["verdicts_flipped"] = flips if inspecting else None
        row["passed"] = drop <= gate.max_map_drop + 1e-9 and flips <= gate.max_flips
    passing = [row for row in rows_ if row["passed"]]
    return min(passing, key=lambda row: row["p50_ms"]) if passing else None


def to_move(choice: dict[str, Any] | None, temporary: Path | None) -> str:
    """What to do when the choice is ``temporary``, the INT8 model tune made in a temporary folder; ""
    otherwise (an ``--int8`` model given is where its user keeps it)."""
    if choice is None or temporary is None or choice["path"] != str(temporary.resolve()):
        return ""
    return (
        f"{choice['path']} is in a temporary folder, which the service cannot see (its unit has PrivateTmp=) "
        "and a reboot empties: copy it where edged reads its models and change path to match "
        "(or run tune with --cache-dir)"
    )


def snippet(choice: dict[str, Any], reason: str) -> str:
    """The ``[model]`` keys of the choice, as TOML to merge into the configuration."""
    return (
        f"# {reason}\n[model]\n"
        f"engine = {json.dumps(choice['engine'])}\nprecision = {json.dumps(choice['precision'])}\n"
        f"path = {json.dumps(choice['path'])}\n"
    )


def format_table(report: dict[str, Any]) -> str:
    lines = [
        f"edged tune: {report['model']} on {report['data']}; {report['machine']['cpu']}, "
        f"load {report['machine']['loadavg_start']}",
        f"gate: at most {report['gate']['max_map_drop']:g} point(s) of mAP@0.5 lost against "
        f"{report['accuracy_against']}, at most {report['gate']['max_flips']} verdict(s) flipped",
        f"accuracy judged on {report['accuracy_on']['summary']}",
        "",
        f"{'engine':<12}{'precision':<10}{'p50 ms':>8}{'p99 ms':>8}{'CPU ms':>8}{'RSS MB':>8}{'mAP50':>8}"
        f"{'drop':>7}{'flips':>6}  passed",
    ]
    for row in report["rows"]:
        flips = "-" if row["verdicts_flipped"] is None else str(row["verdicts_flipped"])
        lines.append(
            f"{row['engine']:<12}{row['precision']:<10}{row['p50_ms']:8.2f}{row['p99_ms']:8.2f}"
            f"{row['cpu_ms_per_frame']:8.2f}{row['rss_mb']:8.0f}{row['map50']:8.3f}{row['map50_drop_points']:7.2f}"
            f"{flips:>6}  {'yes' if row['passed'] else 'NO'}"
        )
    lines += [
        f"{row['engine']} {row['precision']} flipped: " + ", ".join(str(Flip(**flip)) for flip in row["agreement"]["flips"])
        for row in report["rows"]
        if row["agreement"]["flips"]
    ]
    lines += [f"skipped: {reason}" for reason in report["skipped"]]
    choice = report["choice"]
    lines.append("")
    lines.append(f"choice: {choice['engine']} {choice['precision']} ({choice['path']})" if choice else "choice: none")
    return "\n".join(lines)


def _rows(
    args: argparse.Namespace,
    settings: Settings,
    reference: LoadedModel,
    samples: list[EvalSample],
    split: Split,
    inspect: InspectConfig | None,
    made: Path | None,
    log: TextIO,
) -> tuple[list[dict[str, Any]], list[str]]:
    """Every variant this machine runs, the reference first; and why each other one is left out."""
    engines, precisions = set(args.engine.split(",")), set(args.precision.split(","))
    known_engines, known_precisions = dict.fromkeys(e for e, _ in VARIANTS), dict.fromkeys(p for _, p in VARIANTS)
    unknown = (engines - known_engines.keys()) | (precisions - known_precisions.keys())
    if unknown:
        raise UsageError(
            f"no engine or precision named {', '.join(repr(name) for name in sorted(unknown))}: --engine takes "
            f"{','.join(known_engines)} or some of them, --precision {','.join(known_precisions)} or some of them"
        )
    int8: Path | None = None
    if "int8" in precisions:
        int8 = _int8_model(args, settings, reference, split, made, log)
    rows_, skipped = [], []
    for engine, precision in VARIANTS:
        if (engine, precision) != REFERENCE and (engine not in engines or precision not in precisions):
            continue
        print(f"running {engine} {precision} ...", file=log)
        try:
            cfg = _variant_config(settings, engine, precision, int8)
            rows_.append(_variant(settings, cfg, reference, samples, split.judged, args.labels is not None, inspect, args))
        except SetupError as e:
            if (engine, precision) == REFERENCE:  # the one every other is judged against: the configuration's fault
                raise
            reason = "; ".join(e.problems) if isinstance(e, ConfigError) else str(e)
            skipped.append(f"{engine} {precision}: {reason}")
    return rows_, skipped


def run_tune(args: argparse.Namespace, out: TextIO = sys.stdout, log: TextIO = sys.stderr) -> int:
    """``edged tune``: the table (or JSON) on ``out``, the snippet to ``--out``; progress on ``log``."""
    if args.out is not None and args.out.resolve() == args.config.resolve():
        raise UsageError("--out must not be the configuration: tune writes a snippet to merge, it changes no configuration")
    if args.labels is not None and args.images is None:
        raise UsageError("--labels are the labels of --images: give the images too")
    settings = load_config(args.config)
    model = settings.model
    refuse_overwriting({"--out": args.out}, {"model.path": model.path, "model.labels": model.labels, "--int8": args.int8})
    if model.path.is_file() and is_quantised(model.path):
        raise UsageError(
            f"model.path {model.path} is quantised, and tune measures every variant against the FP32 model: "
            "set model.path to the FP32 model it was made from, and give this one as --int8"
        )
    reference = load_model(
        model.model_copy(update={"conf": RANK_CONF, "engine": "onnxruntime", "precision": "f32"}), settings.runtime
    )
    require_task(reference, ("detect", "segment"), "tune", "model.path")  # it compares boxes and verdicts
    if args.images is None:
        check_scene_classes(reference, "run tune on your own images with --images DIR")
    inspect = camera_inspection(settings, args.camera)  # an unknown --camera said now
    check_inspection(reference, inspect, model.conf)
    folder: Path | None = args.cache_dir or settings.runtime.cache_folder()
    temporary = False  # whether tune makes the INT8 model in a temporary folder, not whether it is given one
    made = None
    if args.int8 is None and "int8" in args.precision.split(","):
        # Where tune quantises: a temporary folder when told nowhere (said again below when it is the choice).
        temporary = folder is None
        folder = Path(tempfile.mkdtemp(prefix="edged-tune.")) if folder is None else _cache_folder(folder)
        made = _unused(folder, f"{model.path.stem}.int8")
    choice = None
    try:
        choice = _tune(args, settings, reference, inspect, made, temporary, out, log)
    finally:  # the INT8 model made goes unless it is the choice: after a failure, an interruption, another choice
        if made is not None and (choice is None or choice["precision"] != "int8"):
            made.unlink(missing_ok=True)
            if temporary:
                shutil.rmtree(made.parent, ignore_errors=True)
    return 0


def _tune(
    args: argparse.Namespace,
    settings: Settings,
    reference: LoadedModel,
    inspect: InspectConfig | None,
    made: Path | None,
    temporary: bool,
    out: TextIO,
    log: TextIO,
) -> dict[str, Any] | None:
    """Every variant timed and judged, the report printed and the snippet written; the choice."""
    data, samples = _images(args.images, args.labels, args.max_images, reference.num_classes, log)
    gate = Gate(args.max_map_drop, args.max_flips)
    split = _split(samples, made is not None, args.images is None)
    rows_, skipped = _rows(args, settings, reference, samples, split, inspect, made, log)
    choice = _judge(rows_, gate, inspect is not None)
    judged_on = _judged_on(split, data)
    judged = data if split.judged is samples else f"{len(split.judged)} of the {data}"
    calibrated_on = None if split.held_out is None else {"images": len(split.calibrated), "names": split.calibrated}
    report: dict[str, Any] = {
        "config": str(args.config),
        "model": str(settings.model.path),
        "data": data,
        "accuracy_against": f"labels under {args.labels}" if args.labels else "FP32's own boxes on ONNX Runtime",
        "gate": {"max_map_drop": gate.max_map_drop, "max_flips": gate.max_flips},
        "accuracy_on": {
            "summary": judged_on,
            "images": len(split.judged),
            "names": [sample.name for sample in split.judged],
            "held_out": split.held_out,
            "calibrated_on": calibrated_on,
        },
        "frames": args.frames,
        "rows": rows_,
        "skipped": skipped,
        "choice": None if choice is None else {k: choice[k] for k in ("engine", "precision", "path")},
        "machine": machine_info(),
    }
    print(json.dumps(report, indent=2) if args.json else format_table(report), file=out)
    if args.labels is None and rows_[0]["agreement"]["reference_boxes"] == 0:
        # Every variant then scores 1.0 for finding nothing too, and passes a gate that judged no box.
        print(
            f"warning: FP32 found no box on {judged}: the gate compared no box, only that each variant found none; "
            "run tune on images with the defects the line looks for",
            file=log,
        )
    moved = to_move(choice, made if temporary else None)
    if moved:
        print(f"warning: {moved}", file=log)
    if args.out is not None and choice is not None:
        reason = f"edged tune: the fastest that passed its gate on {data} ({choice['p50_ms']:.2f} ms p50)"
        write_whole(args.out, snippet(choice, reason + (f"\n# {moved}" if moved else "")))
        print(f"wrote {args.out}", file=log)
    return choice
