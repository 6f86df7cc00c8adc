"""The ``edged`` command line: parse arguments, then hand over to the module that does the work.

Errors raised by a command become its exit code here, once: `edged.errors` has the table
(78 for a config, model or contract the daemon must not run with; systemd does not restart on it).
"""

from __future__ import annotations

import argparse
import itertools
import logging
import math
import os
import re
import select
import shlex
import signal
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn, TypeVar, get_args

from edged import __version__
from edged.accept import short_of, why
from edged.config import DEFAULT_CONFIG_PATH, EngineName, Precision, RuntimeConfig, Settings, Spinning, load_config
from edged.errors import EXIT_CONFIG, EXIT_FAILURE, EXIT_OK, ConfigError, EdgedError, MissingDependency, UsageError
from edged.files import refuse_overwriting, write_whole
from edged.keys import SERVICE_USER
from edged.service import Signals, setup_logging

log = logging.getLogger("edged")

N = TypeVar("N", int, float)

MAX_BENCH_CAMERAS = 16  # `bench --cameras`: more than a board serves, and as many `edged run`s at once
MAX_TIMEOUT_S = 86400  # a client's --timeout: a day
# Ctrl-C is how these commands are ended, as mosquitto_sub is: exit 0 wherever it lands, even while the
# modules load (`edged.__main__`), so that a script piping them sees one code for one way of stopping.
ENDED_BY_CTRL_C = frozenset({"subscribe"})


class _Parser(argparse.ArgumentParser):
    """argparse's parser, whose "expected one argument" says how to give a value that starts with '-'
    (a camera id may: ``-a``), which argparse takes for an option unless it is joined by '='.
    ``given``: the command line, the whole of it, for that message to quote."""

    def __init__(self, *args: Any, given: Sequence[str] = (), **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.given = given

    def error(self, message: str) -> NoReturn:
        super().error(message + _joined_value(message, self.given))


def _joined_value(message: str, given: Sequence[str]) -> str:
    """What to type instead, where argparse found an option's value missing because the next word
    starts with '-': ``--camera -a`` is ``--camera`` without its value and an unknown ``-a``."""
    found = re.fullmatch(r"argument (\S+): expected one argument", message)
    if found is None:
        return ""
    names = found[1].split("/")
    long = next((name for name in names if name.startswith("--")), names[0])
    for word, value in itertools.pairwise(given):
        # an option as typed: one of its names, or a long one shortened (argparse takes --cam for --camera)
        typed = word in names or (word.startswith("--") and len(word) > 2 and long.startswith(word))
        if typed and value.startswith("-"):
            return f"; a value that starts with '-' is given joined by '=': {shlex.quote(f'{long}={value}')}"
    return ""


def _config_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config",
        "-c",
        type=Path,
        default=DEFAULT_CONFIG_PATH,
        metavar="PATH",
        help=f"TOML config file (default {DEFAULT_CONFIG_PATH}); EDGED_* variables override it",
    )


def _eval_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=Path, required=True, help="ONNX model to evaluate")
    p.add_argument("--labels", type=Path, default=None, help="class names file (default: model metadata)")
    data = p.add_mutually_exclusive_group(required=True)
    data.add_argument(
        "--data",
        type=Path,
        help="folder of images with YOLO-format .txt labels; for a classification model, a folder per class "
        "(or its val/ subfolder), as yolo val reads it",
    )
    data.add_argument("--scenes", type=_positive, metavar="N", help="evaluate on N generated inspection scenes")
    p.add_argument("--seed", type=_non_negative, default=0, help="scene seed (0 is held out from the demo's training)")
    p.add_argument("--size", default="1280x720", help="scene size WxH (default 1280x720)")
    p.add_argument("--conf", type=float, default=0.001, help="score threshold for mAP (default 0.001)")
    p.add_argument(
        "--report-conf",
        type=_fraction,
        default=0.25,
        help="score at which precision and recall are reported (default 0.25, the daemon's)",
    )
    p.add_argument(
        "--iou", type=float, default=0.7, help="NMS IoU threshold (default 0.7, yolo val's; the daemon's model.iou is 0.45)"
    )
    p.add_argument("--max-det", type=int, default=300, help="detections kept per image (default 300, yolo val's)")
    p.add_argument(
        "--coco",
        action="store_true",
        help="score as pycocotools' COCOeval (needs pycocotools) instead of as yolo val (the default)",
    )
    p.add_argument("--json", type=_output_file, default=None, help="also write the report as JSON to this file")


def _quantize_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=Path, required=True, help="FP32 ONNX model to quantise")
    p.add_argument("--out", type=_output_file, required=True, help="where to write the INT8 (QDQ) model")
    calib = p.add_mutually_exclusive_group()
    calib.add_argument("--calib-images", type=Path, metavar="DIR", help="calibrate on the images in this folder")
    calib.add_argument(
        "--calib-scenes",
        type=_positive,
        default=200,
        metavar="N",
        help="calibrate on N generated 1280x720 scenes (default 200)",
    )
    p.add_argument(
        "--seed", type=_non_negative, default=1, help="calibration scene seed (default 1, a training seed; 0 stays held out)"
    )
    p.add_argument(
        "--method",
        choices=("minmax", "percentile"),
        default="percentile",
        help="activation range calibration (default percentile: 99.999th, measured better on the demo)",
    )
    p.add_argument(
        "--exclude-head",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="keep the detection head (box decode, sigmoid, final concat) in float (default on)",
    )
    p.add_argument(
        "--float-stem",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="keep the convolutions that read the image in float (default on: int8 over 3 channels "
        "is slower than float in onnxruntime); quantised, they let the INT8 model take the "
        "uint8 pixels as they are",
    )
    p.add_argument(
        "--reduce-range",
        action="store_true",
        help="7-bit weights; only for x86 CPUs without VNNI, where u8 x s8 sums can saturate",
    )
    _comparison_arguments(p)


def _tune_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config", type=Path, required=True, help="the configuration to tune: its model, [runtime] and [inspect]"
    )
    p.add_argument("--images", type=Path, metavar="DIR", help="run on these images (default: generated scenes)")
    p.add_argument(
        "--labels", type=Path, metavar="DIR", help="YOLO labels of --images (DIR/NAME.txt): accuracy against them"
    )
    p.add_argument("--max-images", type=_positive, default=20, metavar="N", help="the first N images or scenes (default 20)")
    p.add_argument(
        "--int8",
        type=Path,
        metavar="MODEL",
        help="an `edged quantize` model, judged on every image (default: quantise here, see above)",
    )
    _camera_argument(p)
    p.add_argument(
        "--cache-dir",
        type=Path,
        metavar="DIR",
        help="where tune writes the INT8 model it makes (default runtime.cache_dir, else a new temp folder)",
    )
    p.add_argument("--engine", default="onnxruntime,openvino", help="engines, comma-separated (default both)")
    p.add_argument(
        "--precision", default="f32,bf16,f16,int8", help="precisions, comma-separated (default f32,bf16,f16,int8)"
    )
    p.add_argument("--frames", type=_positive, default=100, metavar="N", help="timed frames per variant (default 100)")
    p.add_argument("--warmup", type=_non_negative, default=10, metavar="N", help="warm-up frames per variant (default 10)")
    p.add_argument(
        "--max-map-drop",
        type=_non_negative_float,
        default=1.0,
        metavar="POINTS",
        help="gate: points of mAP@0.5 a variant may lose against FP32 (default 1)",
    )
    p.add_argument(
        "--max-flips",
        type=_non_negative,
        default=0,
        metavar="N",
        help="gate: images whose OK/NG verdict may flip (default 0)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--out", type=_output_file, metavar="SNIPPET", help="write the choice as a [model] TOML snippet here")


def _camera_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--camera",
        metavar="ID",
        help="judge verdicts as this camera of the configuration does, with its [source.inspect] keys "
        "(mm_per_px, zones, ...) over [inspect] (default: the first camera)",
    )


def _comparison_arguments(p: argparse.ArgumentParser) -> None:
    """How `edged quantize` compares the INT8 model with the original."""
    p.add_argument(
        "--eval-scenes",
        type=_non_negative,
        default=200,
        metavar="N",
        help="held-out scenes for the FP32 vs INT8 accuracy comparison (default 200; 0 skips it)",
    )
    p.add_argument("--eval-seed", type=_non_negative, default=0, help="scene seed of the comparison (default 0, held out)")
    p.add_argument(
        "--data",
        type=Path,
        metavar="DIR",
        help="compare on these images instead of scenes (an evidence folder works): INT8 against FP32's own boxes, "
        "and against YOLO labels where there are label files",
    )
    p.add_argument(
        "--config",
        type=Path,
        metavar="FILE",
        help="compare OK/NG verdicts under this configuration's inspection (its first camera's) and model.conf",
    )
    _camera_argument(p)
    p.add_argument(
        "--latency-frames",
        type=_non_negative,
        default=200,
        metavar="N",
        help="interleaved frames per model for the latency comparison (default 200; 0 skips it)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=0,
        metavar="N",
        help="runtime.intra_op_threads for both models (default 0: one per physical core); INT8's gain depends on it",
    )
    p.add_argument(
        "--report",
        type=_output_file,
        default=None,
        metavar="FILE",
        help="also write the before/after report as JSON to this file",
    )


def _add_client_keys(p: argparse.ArgumentParser) -> None:
    """The CURVE options of a command that connects to edged (subscribe, trigger)."""
    p.add_argument(
        "--server-key", type=Path, default=None, metavar="FILE", help="CURVE: edged's public key file (server.key)"
    )
    p.add_argument(
        "--client-key",
        type=Path,
        default=None,
        metavar="FILE",
        help="CURVE: this client's secret key file (NAME.key_secret, mode 0600)",
    )


def _output_file(text: str) -> Path:
    """A file a command writes once its work is done: its folder is checked now, not after the work."""
    path = Path(text)
    folder = path.parent
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{path} is a folder: name a file in it")
    if path.exists() and not path.is_file():  # a pipe would hold the command up once its work is done
        raise argparse.ArgumentTypeError(f"{path} is not a regular file (a pipe or a device): name a file")
    if not folder.is_dir():
        raise argparse.ArgumentTypeError(f"no folder {folder} to write {path.name} in: create it first")
    if not os.access(folder, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise argparse.ArgumentTypeError(f"{path} cannot be written by this user")
    return path


def _endpoint(text: str) -> str:
    """An address to connect to, tried on a throwaway socket: libzmq's refusal, later, was a traceback."""
    import zmq

    from edged.listen import socket_with_room

    try:
        sock = socket_with_room(zmq.Context.instance(), zmq.SUB)
    except OSError:
        return text  # no room to try it on: the command's own socket says what ran out
    try:
        sock.connect(text)
    except zmq.ZMQError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not an address to connect to: tcp://HOST:PORT or ipc:///PATH"
        ) from None
    finally:
        sock.close(linger=0)
    return text


def _folder(text: str) -> Path:
    path = Path(text)
    if not path.is_dir():
        raise argparse.ArgumentTypeError(f"no folder {path}")
    return path


def _number(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
    return value


def _bounded(parse: Callable[[str], N], allowed: Callable[[N], bool], expected: str, kind: str) -> Callable[[str], N]:
    """An argparse type: ``parse`` (argparse names it ``kind`` when it fails), then refuse what
    ``allowed`` refuses, saying what was ``expected``."""

    def check(text: str) -> N:
        value = parse(text)
        if not allowed(value):
            raise argparse.ArgumentTypeError(f"must be {expected}, got {text}")
        return value

    check.__name__ = kind
    return check


_positive = _bounded(int, lambda v: v >= 1, ">= 1", "whole number")
_non_negative = _bounded(int, lambda v: v >= 0, ">= 0", "whole number")
# bench --cameras: each N starts N `edged run`s, each holding a model and its frames.
_camera_count = _bounded(int, lambda v: 1 <= v <= MAX_BENCH_CAMERAS, f"from 1 to {MAX_BENCH_CAMERAS}", "whole number")
# Seconds or a rate: 0 would make a loop spin or a wait end at once.
_positive_float = _bounded(_number, lambda v: v > 0, "> 0", "number")
# A client's wait: ZeroMQ polls in int milliseconds, which overflow past 24 days.
_timeout_s = _bounded(_number, lambda v: 0 < v <= MAX_TIMEOUT_S, f"above 0 and at most {MAX_TIMEOUT_S} s", "number")
_non_negative_float = _bounded(_number, lambda v: v >= 0, ">= 0", "number")
# thermal --interval, as thermal.poll_interval_s: 1e300 s overflowed time.sleep, a traceback.
_interval_s = _bounded(_number, lambda v: 0 < v <= 600, "above 0 and at most 600 s", "number")
_fraction = _bounded(_number, lambda v: 0 < v <= 1, "above 0 and at most 1", "number")  # a score, as model.conf


def _names(choices: tuple[str, ...]) -> Callable[[str], list[str]]:
    """An option's comma-separated list of ``choices``, each checked, in the order given."""

    def parse(text: str) -> list[str]:
        names = [name.strip() for name in text.split(",") if name.strip()]
        wrong = [name for name in names if name not in choices]
        if wrong or not names:
            raise argparse.ArgumentTypeError(f"{', '.join(wrong) or 'nothing'} given; choose from {', '.join(choices)}")
        return list(dict.fromkeys(names))

    return parse


def _bench_arguments(p: argparse.ArgumentParser) -> None:
    spinning = RuntimeConfig.model_fields["spinning"].default
    p.add_argument("--model", type=Path, default=None, metavar="PATH", help="ONNX model to time (default: models/demo.onnx)")
    p.add_argument("--frames", type=_positive, default=300, help="timed frames per row (default 300)")
    p.add_argument("--warmup", type=_positive, default=20, help="untimed frames first (default 20)")
    p.add_argument(
        "--cpu-frames", type=_positive, default=None, help="frames per row in the CPU-time blocks (default: frames / 3)"
    )
    p.add_argument("--alloc-frames", type=_positive, default=100, help="frames in the heap measurement (default 100)")
    p.add_argument(
        "--spinning",
        choices=get_args(Spinning),
        default=spinning,
        help=f"runtime.spinning for the session (default {spinning})",
    )
    p.add_argument("--threads", type=int, default=0, help="runtime.intra_op_threads (default 0: one per physical core)")
    p.add_argument(
        "--engine",
        type=_names(get_args(EngineName)),
        default=["onnxruntime"],
        metavar="NAME[,NAME]",
        help="model.engine, or several comma-separated: their rows side by side (default onnxruntime)",
    )
    p.add_argument(
        "--precision",
        type=_names(get_args(Precision)),
        default=["f32"],
        metavar="P[,P]",
        help="model.precision, or several comma-separated, for each engine that runs it (default f32)",
    )
    p.add_argument(
        "--int8",
        type=Path,
        metavar="MODEL",
        help="an `edged quantize` model for the int8 rows, beside --model's float rows (default: --model)",
    )
    p.add_argument("--conf", type=_fraction, default=0.25, help="model.conf (default 0.25)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument(
        "--cold-start",
        action="store_true",
        help="instead of the per-frame rows: time `edged run` from process start to the "
        "first detections message, without and with the optimised-model cache",
    )
    p.add_argument("--cold-runs", type=_positive, default=3, help="cold-start trials (default 3)")
    p.add_argument(
        "--soak",
        type=_positive,
        default=None,
        metavar="N",
        help="instead of the per-frame rows: run the full path N frames and report RSS and traced memory every N/10 "
        "frames, for each --engine and --precision in turn",
    )
    p.add_argument(
        "--cameras",
        type=_camera_count,
        nargs="+",
        default=None,
        metavar="N",
        help="instead of the per-frame rows: N synthetic 1280x720 cameras served by one `edged run`, "
        "against N `edged run`s side by side (each N given: total fps, frame age, CPU per frame, RSS)",
    )
    p.add_argument(
        "--journal",
        action="store_true",
        help="instead of the per-frame rows: the verdict journal's cost, offer and offer to commit, per durability, "
        "--frames verdicts at --camera-fps",
    )
    p.add_argument("--journal-dir", type=_folder, default=None, help="with --journal: a folder on the disk to measure")
    p.add_argument(
        "--reject",
        action="store_true",
        help="instead of the per-frame rows: the reject line's pulse lateness for --frames NG parts, idle and with "
        "every core busy, on gpio-sim where the kernel has it, else on a line recorded at the gpiod boundary",
    )
    p.add_argument(
        "--opcua",
        action="store_true",
        help="instead of the per-frame rows: capture to OPC UA node update and to a subscriber's notification, "
        "p50/p99, over --frames verdicts of an `edged run` at --camera-fps (needs asyncua)",
    )
    p.add_argument(
        "--modbus",
        action="store_true",
        help="instead of the per-frame rows: `edged run` with [modbus], --frames verdicts at --camera-fps, "
        "capture to the register update and to a polling client's read, p50 and p99 (needs pymodbus)",
    )
    p.add_argument(
        "--abuse",
        action="store_true",
        help="with --modbus: instead, the loop's frame rate quiet, then while clients misbehave (200 connections, "
        "malformed frames, unknown function codes, answers never read), then quiet again; with --opcua: the same "
        "with 50 sessions, one a subscriber that never acknowledges",
    )
    p.add_argument(
        "--abuse-s",
        type=_positive_float,
        default=10.0,
        help="with --abuse: seconds of each of the three phases (default 10)",
    )
    p.add_argument("--camera-fps", type=_positive_float, default=10.0, help="each camera's rate with --cameras (default 10)")
    p.add_argument(
        "--camera-source",
        choices=("synthetic", "video"),
        default="synthetic",
        help="with --cameras: synthetic sources, or an MJPG clip decoded like a UVC camera's frames (default synthetic)",
    )
    p.add_argument(
        "--repeat",
        type=_positive,
        default=1,
        help="with --cameras: measure each arrangement this many times, interleaved, and report medians (default 1)",
    )
    p.add_argument("--seconds", type=_positive_float, default=20.0, help="measured seconds per arrangement (default 20)")
    p.add_argument("--warmup-s", type=_non_negative_float, default=5.0, help="seconds let pass before measuring (default 5)")


def _subscribe_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("endpoint", type=_endpoint, help="e.g. tcp://127.0.0.1:5556 or ipc:///run/edged/detections.sock")
    p.add_argument("--topic", default="", help="topic prefix to subscribe to (default: everything)")
    p.add_argument("--stats", action="store_true", help="print a rolling summary instead of messages")
    p.add_argument("--json", action="store_true", help="print each message as JSON")
    p.add_argument("--count", type=_positive, default=None, help="exit after this many messages")
    p.add_argument("--timeout", type=_timeout_s, default=None, help="give up after this many seconds")
    _add_client_keys(p)


def _trigger_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("endpoint", type=_endpoint, help="edged's trigger.endpoint, e.g. tcp://127.0.0.1:5557")
    p.add_argument("--part-id", default=None, help="the part's id, carried into the verdict and detections messages")
    p.add_argument("--camera", default=None, help="the camera_id to inspect with; needed when several cameras take requests")
    p.add_argument("--timeout", type=_timeout_s, default=5.0, help="seconds to wait for the reply (default 5)")
    p.add_argument("--json", action="store_true", help="print the verdict message as JSON")
    _add_client_keys(p)


def _history_arguments(p: argparse.ArgumentParser) -> None:
    _config_arg(p)
    p.add_argument("--journal", type=Path, default=None, help="the journal file (default: journal.path of --config)")
    p.add_argument("--part-id", default=None, help="only this part's entries")
    p.add_argument("--camera", default=None, help="only this camera's entries")
    p.add_argument("--since", default=None, metavar="TIME", help="from this time: ISO 8601 (local time) or an age, 2h, 7d")
    p.add_argument("--until", default=None, metavar="TIME", help="before this time, as --since")
    p.add_argument("--verdict", choices=("ok", "ng", "uncertain"), default=None, help="only this verdict")
    p.add_argument("--detections", action="store_true", help="the detections entries (journal.detections) instead")
    p.add_argument("--limit", type=_positive, default=100, help="the newest N entries, shown oldest first (default 100)")
    out = p.add_mutually_exclusive_group()
    out.add_argument("--json", action="store_const", dest="format", const="json", help="a JSON array, messages parsed")
    out.add_argument("--csv", action="store_const", dest="format", const="csv", help="CSV with every column")


def _keygen_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("dir", type=Path, help="directory for the key files (created if missing)")
    p.add_argument("--name", default="server", help="'server' for the publisher (default), or a name for a subscriber")
    p.add_argument(
        "--user",
        default=SERVICE_USER,
        help=f"the user edged runs as (default {SERVICE_USER}, the units' User=): the publisher's secret key becomes "
        "its own and the directories keygen creates its group's",
    )


def _sign_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", type=Path, help="the ONNX model file to sign")
    p.add_argument("--key", type=Path, required=True, help="the ed25519 private key (PEM), kept off the board")
    p.add_argument("--labels", type=Path, default=None, help="the labels file model.labels will name, if any")
    p.add_argument("--out", type=_output_file, default=None, help="the signature file (default: MODEL.sig beside the model)")


def _promote_arguments(p: argparse.ArgumentParser) -> None:
    _config_arg(p)
    p.add_argument("--force", action="store_true", help="promote although the trial has not passed its gate")
    p.add_argument("--reason", default=None, help="why a forced promotion is made: logged with the user")
    p.add_argument("--timeout", type=_timeout_s, default=10.0, help="seconds to wait for the answer (default 10)")


def _rollback_arguments(p: argparse.ArgumentParser) -> None:
    _config_arg(p)
    p.add_argument("--timeout", type=_timeout_s, default=10.0, help="seconds to wait for the answer (default 10)")


def _schema_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", type=_output_file, default=None, help="write to this file instead of stdout")


def _check_arguments(p: argparse.ArgumentParser) -> None:
    _config_arg(p)
    p.add_argument(
        "--no-bind",
        action="store_true",
        help="for a check beside the running service, which holds its addresses and reject lines: an address "
        "another program holds is passed over, not refused, and reject lines are found but not requested "
        "(one another program holds is refused, as run refuses it)",
    )


def _thermal_arguments(p: argparse.ArgumentParser) -> None:
    _config_arg(p)
    p.add_argument("--watch", action="store_true", help="keep printing every poll interval")
    p.add_argument("--interval", type=_interval_s, default=None, help="seconds between readings")
    p.add_argument("--root", type=_folder, default=None, help="read this tree instead of /")


def _calibrate_arguments(p: argparse.ArgumentParser) -> None:
    _config_arg(p)
    p.add_argument("--good", type=Path, default=None, metavar="DIR", help="a folder of images of good parts")
    p.add_argument(
        "--frames", type=_positive, default=None, metavar="N", help="instead of --good: N frames of the configured camera"
    )
    p.add_argument(
        "--bad", type=Path, default=None, metavar="DIR", help="a folder of images of bad parts: report the separation"
    )


# Each command: its name, its one-line help, its description and what adds its arguments, in the order
# `edged --help` lists them.
SUBCOMMANDS: tuple[tuple[str, str, str, Callable[[argparse.ArgumentParser], None]], ...] = (
    (
        "run",
        "run the daemon",
        "Run the daemon: capture frames, detect, publish over ZeroMQ until SIGTERM. "
        "SIGHUP reloads the config (a bad one is logged and the running one kept). "
        "Exit 0 on a clean stop, 78 on a config/model/contract error, 1 otherwise.",
        _config_arg,
    ),
    (
        "check",
        "check config, model, cameras, folders and addresses before `run`",
        "Load the config and model exactly as `run` would, check the layout contract, open every "
        "camera and run its first frame, create and remove a file in each evidence folder, bind and "
        "release every address edged listens on, and print what `run` will do and which execution "
        "provider each node runs on. Exit 0 when all is well; 78 for a configuration, model or "
        "contract problem; 1 for a camera, broker, folder or address that cannot be used now (a "
        "port in use: another program, or the running service, holds it; see --no-bind).",
        _check_arguments,
    ),
    (
        "subscribe",
        "print detections from a running edged",
        "Connect to an edged PUB endpoint and print what arrives. Exits 0 once every camera it has "
        "heard from says in its status that its source ended (a video file or image folder played to "
        "its end: the daemon stops then), and on Ctrl-C, which is how one stops it.",
        _subscribe_arguments,
    ),
    (
        "trigger",
        "inspect one part: ask edged in request mode for a verdict",
        "Send one inspection request to edged in request mode (trigger.mode = "
        '"request") and print the verdict of a frame captured after the request. Exit 0 when the '
        "part is OK, 3 when it is NG, 1 when there is no verdict (an error reply such as a lost "
        "camera, or no reply in time).",
        _trigger_arguments,
    ),
    (
        "history",
        "what the verdict journal says, by part, camera, time and verdict",
        "Print the journal's verdicts (or, with --detections, its detections entries) that match every "
        "filter given: the newest --limit, oldest first, as a table, --json or --csv. It reads the "
        "journal read-only and is safe while edged runs. Exit 1 when there is no journal to read.",
        _history_arguments,
    ),
    (
        "promote",
        "make the candidate model live once its shadow trial passed",
        "Ask the running edged (found from --config: model.candidate.control) to make the candidate "
        "of [model.candidate] the live model, between two frames, keeping the previous one for "
        "`edged rollback`. Refused, naming why, until the shadow trial has passed its gate (enough "
        "frames, agreement, no class missed), unless --force with --reason, which the log keeps "
        "with the user. Prints what is live now. Exit 0 when promoted, 1 when refused or unanswered, "
        "2 for --force without --reason, before anything is sent.",
        _promote_arguments,
    ),
    (
        "rollback",
        "return to the model a promotion replaced",
        "Ask the running edged to make the model that `edged promote` replaced live again, between "
        "two frames, with no restart; the candidate goes back on trial. Prints what is live now. "
        "Exit 0 when rolled back, 1 when there was nothing to roll back or no answer.",
        _rollback_arguments,
    ),
    (
        "sign",
        "sign a model for boards that require signed models",
        "Write MODEL.sig: an ed25519 signature over the model file's sha256 and its labels "
        "file's (or the model's own names), which edged checks with model.require_signature "
        "before it serves the model. Keys: openssl genpkey -algorithm ed25519 -out signing.pem; "
        "the board gets only the public half (openssl pkey -in signing.pem -pubout).",
        _sign_arguments,
    ),
    (
        "keygen",
        "create a CURVE key pair for the tcp stream",
        "Write NAME.key (public, 0644) and NAME.key_secret (secret, 0600) "
        "into DIR, and print where each one goes. The publisher's pair (the default name, server) "
        "comes with DIR/clients/ for the allowed subscribers' public keys, its secret owned by the "
        "service user and the directories 0750 in its group; without root, keygen prints the "
        "commands that hand them over.",
        _keygen_arguments,
    ),
    (
        "schema",
        "print the JSON Schema of published messages",
        "Print the JSON Schema generated from the message models.",
        _schema_arguments,
    ),
    (
        "config-reference",
        "print the configuration reference (Markdown)",
        "Print the configuration reference generated from the settings models: every table and key "
        "with its type, default, bounds and description (docs/configuration.md).",
        _schema_arguments,
    ),
    (
        "eval",
        "measure a model's precision, recall and mAP",
        "Run a model through the daemon's exact pipeline over a folder "
        "of images with YOLO-format labels, or over generated scenes, and report "
        "precision, recall, mAP@0.5 and mAP@0.5:0.95 per class, computed as yolo val "
        "computes them (ultralytics 8.4) or, with --coco, as pycocotools' COCOeval.",
        _eval_arguments,
    ),
    (
        "calibrate",
        "propose an anomaly model's thresholds from images of good parts",
        "Run an anomaly model (an anomalib export) through the daemon's pipeline over a folder of images "
        "of good parts, print the distribution of their scores and propose model.anomaly_threshold and "
        "model.pixel_threshold as a config snippet; with --bad, report the image AUROC and the best F1 "
        "threshold. Exit 0; 78 for a configuration or model problem, a model of another task included; "
        "65 for unusable images.",
        _calibrate_arguments,
    ),
    (
        "quantize",
        "write a static INT8 copy of a model and compare it",
        "Quantise a model to INT8 (QDQ, per-channel int8 weights, uint8 "
        "activations) calibrated on frames through the daemon's preprocess, keeping the "
        "detection head in float; then compare latency and accuracy with the original. "
        "Exit 0 on success, 78 for an unusable model or data (an anomaly model included), 1 when "
        "quantising fails or the quantised model does not load or run.",
        _quantize_arguments,
    ),
    (
        "tune",
        "choose the fastest engine and precision that keeps the accuracy",
        "Run each engine x precision this machine offers (ONNX Runtime f32 and int8, OpenVINO f32, bf16, "
        "f16 and int8) through the daemon's full per-frame path on your images, measure latency, CPU and "
        "memory and the accuracy against FP32 (or labels), gate it, and write the fastest that passes as a "
        "[model] snippet. The INT8 model it makes (no --int8) is calibrated on every other one of your images by "
        "name and every row's accuracy judged on the others only (fewer than 16: on the same ones, as it says; "
        "generated scenes: calibrated on others). "
        "It changes no configuration. Exit 78 for a configuration or model problem, a "
        "model other than a detection or segmentation model included.",
        _tune_arguments,
    ),
    (
        "bench",
        "time edged's per-frame path against bare inference",
        "Measure, in one process and interleaved, bare session.run (the floor), "
        "edged's full per-frame path and a naive reference pipeline on a 1280x720 scene; "
        "also allocations, CPU time, RSS, cold start (--cold-start), a soak (--soak N), and "
        "several cameras in one process against a process each (--cameras N [N ...]).",
        _bench_arguments,
    ),
    (
        "thermal",
        "print thermal readings and state",
        "Read thermal zones, cpufreq caps and throttling flags once "
        "(or repeatedly with --watch) and print them with the resulting state.",
        _thermal_arguments,
    ),
)


def _parser(given: Sequence[str] = ()) -> argparse.ArgumentParser:
    """The parser of every command; ``given``, the command line, for its messages (`_Parser`)."""
    parser = _Parser(
        prog="edged",
        description="Embedded vision daemon: camera -> ONNX Runtime -> detections over ZeroMQ.",
        given=given,
    )
    parser.add_argument("--version", action="version", version=f"edged {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)
    for name, help_text, description, add_arguments in SUBCOMMANDS:
        # each command's parser quotes the command line too
        add_arguments(sub.add_parser(name, help=help_text, description=description, given=given))
    return parser


def _cmd_run(args: argparse.Namespace) -> int:
    # Nothing edged makes is another user's to write, whatever umask a shell started it with (000 made its
    # evidence folders anyone's, and its ipc sockets anyone's to connect to until their chmod).
    os.umask(os.umask(0) | 0o002)
    signals = Signals()  # first: a SIGHUP while a slow board reads the config or imports would end edged
    signals.install()
    setup_logging("warning")  # loading the config may warn before it says which level to log at
    settings = load_config(args.config)
    setup_logging(settings.service.log_level)
    return _serve(args.config, settings, signals)


def _serve(config_path: Path | None, settings: Settings, signals: Signals) -> NoReturn:
    """The process around an `edged.daemon.Daemon`: exits with its exit code (`edged.service.exit_safely`).

    Every way out, a refused start included, stops the capture thread first; one still inside a
    camera call after its join is abandoned by the exit, which skips interpreter finalisation.
    A stop asked for during the start ends it there, exit 0 (`edged.service.Signals.unless_stopped`).
    """
    from edged.daemon import Daemon
    from edged.service import Notifier, StartStopped, StartTimeout, exit_safely

    notifier = Notifier()
    try:
        with StartTimeout(notifier, signals):
            daemon = Daemon(settings, config_path, notifier, signals)
    except StartStopped:
        log.info("stopped before the start had finished")
        code = EXIT_OK
    except EdgedError as e:
        if isinstance(e, ConfigError) and e.path is None:  # found with the model or a camera: named as the file's own
            e = ConfigError(config_path, e.problems)
        log.error("%s", e)
        notifier.status(f"refused to start: {e}" if e.exit_code == EXIT_CONFIG else f"cannot start: {e}")
        code = e.exit_code
    except Exception as e:
        if not short_of(e):
            raise
        log.error("cannot start: %s", why(e))  # the process's limits, not the configuration: exit 1, tried again
        notifier.status(f"cannot start: {why(e)}")
        code = EXIT_FAILURE
    else:
        code = daemon.run()
    notifier.close()
    exit_safely(code)


def _cmd_check(args: argparse.Namespace) -> int:
    setup_logging("warning")
    from edged.unit import Unit

    unit = Unit.checked_as(args.config)
    if unit is not None:  # the service's folders follow the directories systemd makes for it: so do the check's
        os.environ.update(unit.environment())
    settings = load_config(args.config)
    from edged.check import run_check

    return run_check(args.config, settings, unit, bind=not args.no_bind)


def _cmd_subscribe(args: argparse.Namespace) -> int:
    from edged.subscribe import run_subscribe

    return run_subscribe(
        args.endpoint,
        args.topic,
        stats=args.stats,
        raw_json=args.json,
        count=args.count,
        timeout_s=args.timeout,
        server_key=args.server_key,
        client_key=args.client_key,
    )


def _cmd_trigger(args: argparse.Namespace) -> int:
    from edged.trigger import run_trigger

    return run_trigger(
        args.endpoint,
        args.part_id,
        args.timeout,
        camera_id=args.camera,
        raw_json=args.json,
        server_key=args.server_key,
        client_key=args.client_key,
    )


def _cmd_history(args: argparse.Namespace) -> int:
    from edged.history import Query, run_history
    from edged.journal import records

    journal: Path | None = args.journal
    journal_off = records_nothing = False
    if journal is None:
        settings = load_config(args.config)
        journal, journal_off, records_nothing = settings.journal.file, not settings.journal.enabled, not records(settings)
    query = Query.parse(
        part_id=args.part_id,
        camera_id=args.camera,
        since=args.since,
        until=args.until,
        verdict=args.verdict,
        detections=args.detections,
        limit=args.limit,
    )
    return run_history(journal, query, args.format or "table", journal_off=journal_off, records_nothing=records_nothing)


def _cmd_keygen(args: argparse.Namespace) -> int:
    from edged.keys import run_keygen

    return run_keygen(args.dir, args.name, args.user)


def _cmd_sign(args: argparse.Namespace) -> int:
    from edged.signature import sign, signature_path

    for path in (args.model, args.labels):
        if path is not None and not path.is_file():
            raise UsageError(f"{path} is not a file")
    out = signature_path(args.model, args.out)
    refuse_overwriting({"--out": out}, {"the model": args.model, "--key": args.key, "--labels": args.labels})
    text = sign(args.model, args.labels, args.key)
    if args.key.stat().st_mode & 0o077:  # kept off the board, and still a secret: ssh would refuse it
        print(f"warning: others may read the private key {args.key}: chmod 600 {args.key}", file=sys.stderr)
    write_whole(out, text)
    print(f"signed {args.model} ({text.splitlines()[1].split()[1][:12]}) into {out}")
    return 0


def _cmd_control(args: argparse.Namespace) -> int:
    from edged.control import run_control

    candidate = load_config(args.config).model.candidate
    if candidate is None:
        raise UsageError(f"{args.config} has no [model.candidate]: there is no trial to promote or roll back")
    force, reason = getattr(args, "force", False), getattr(args, "reason", None)
    return run_control(candidate.control, args.command, force=force, reason=reason, timeout_s=args.timeout)


def _emit(text: str, out: Path | None) -> int:
    """A generated document to ``out``, or to stdout without one."""
    if out:
        write_whole(out, text)
    else:
        sys.stdout.write(text)
    return 0


def _cmd_schema(args: argparse.Namespace) -> int:
    from edged.messages import schema_text

    return _emit(schema_text(), args.out)


def _cmd_config_reference(args: argparse.Namespace) -> int:
    from edged.tools.reference import reference_text

    return _emit(reference_text(), args.out)


def _cmd_thermal(args: argparse.Namespace) -> int:
    from edged.config import ThermalConfig
    from edged.thermal_command import run_thermal_command

    cfg = ThermalConfig()
    if args.config.is_file():
        cfg = load_config(args.config).thermal
    if args.root is not None:
        cfg = cfg.model_copy(update={"root": args.root})
    setup_logging("warning")
    return run_thermal_command(cfg, watch=args.watch, interval_s=args.interval, out=sys.stdout)


def _cmd_eval(args: argparse.Namespace) -> int:
    from edged.tools.evaluate import run_eval

    setup_logging("warning")
    return run_eval(args)


def _cmd_calibrate(args: argparse.Namespace) -> int:
    from edged.tools.calibrate import run_calibrate

    setup_logging("warning")
    return run_calibrate(args, load_config(args.config), sys.stdout)


def _cmd_quantize(args: argparse.Namespace) -> int:
    try:
        from edged.tools.quantize import run_quantize
    except ImportError as e:
        raise MissingDependency(f"quantize needs the onnx package (pip install onnx): {e}") from None
    setup_logging("warning")
    signal.signal(signal.SIGTERM, _exit_on_signal)  # as Ctrl-C: its temporary files are removed on the way out
    return run_quantize(args)


def _cmd_tune(args: argparse.Namespace) -> int:
    from edged.tools.tune import run_tune

    setup_logging("warning")
    signal.signal(signal.SIGTERM, _exit_on_signal)  # as Ctrl-C: the INT8 model it was making is removed
    return run_tune(args)


def _cmd_bench(args: argparse.Namespace) -> int:
    from edged.tools.bench import run_bench

    setup_logging("warning")
    # SIGTERM (timeout, systemctl) ends a bench as Ctrl-C does: through the blocks that kill the
    # `edged run`s and busy processes it started, which would otherwise run on, orphaned.
    signal.signal(signal.SIGTERM, _exit_on_signal)
    return run_bench(args)


def _exit_on_signal(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


COMMANDS = {
    "run": _cmd_run,
    "check": _cmd_check,
    "subscribe": _cmd_subscribe,
    "trigger": _cmd_trigger,
    "schema": _cmd_schema,
    "config-reference": _cmd_config_reference,
    "thermal": _cmd_thermal,
    "eval": _cmd_eval,
    "calibrate": _cmd_calibrate,
    "bench": _cmd_bench,
    "quantize": _cmd_quantize,
    "tune": _cmd_tune,
    "sign": _cmd_sign,
    "promote": _cmd_control,
    "rollback": _cmd_control,
    "keygen": _cmd_keygen,
    "history": _cmd_history,
}


def _standard_descriptors() -> None:
    """Descriptors 0 to 2 open, on /dev/null where the parent closed one (``edged run 2>&-``): else the
    next file edged opens (the journal's database, an evidence image) takes that number, and what a
    library writes to its standard error (FFmpeg, ONNX Runtime, libzmq's last words) goes into it."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            os.open(os.devnull, os.O_RDWR)  # the lowest free number: this one


def _reader_gone() -> bool:
    """Whether standard output's reader has gone (``edged check | head``): its end of the pipe is then
    in error. The reader has what it wanted, so a command so cut off ends quietly, exit 0."""
    poller = select.poll()
    poller.register(1, select.POLLOUT)
    return any(events & select.POLLERR for _, events in poller.poll(0))


def main(argv: list[str] | None = None, *, interrupted: bool = False) -> int:
    """Run the command ``argv`` names; ``interrupted``: a Ctrl-C came while the modules loaded
    (`edged.__main__`), which ends it as one in the command would, once its name is known."""
    _standard_descriptors()
    given = sys.argv[1:] if argv is None else argv
    args = _parser(given).parse_args(given)
    try:
        if interrupted:
            raise KeyboardInterrupt
        code = COMMANDS[args.command](args)
        if sys.stdout is not None:  # None where descriptor 1 was closed when Python started
            sys.stdout.flush()  # a reader gone is found here, not in Python's flush at exit
        return code
    except EdgedError as e:
        # The one place an error becomes an exit code (edged.errors has the table).
        what = "configuration error" if isinstance(e, ConfigError) else f"{args.command} failed"
        print(f"edged: {what}: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:  # Ctrl-C in a tool: what it started is undone on the way here, no traceback
        if args.command in ENDED_BY_CTRL_C:
            return EXIT_OK
        print(f"edged: {args.command} interrupted", file=sys.stderr)
        return 128 + signal.SIGINT
    except BrokenPipeError:
        if not _reader_gone():
            raise
        os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # else the flush at exit fails again
        return 0
    except Exception as e:  # the process short of descriptors, memory or threads: said, not a traceback
        if not short_of(e):
            raise
        print(f"edged: {args.command} failed: {why(e)}", file=sys.stderr)
        return EXIT_FAILURE


if __name__ == "__main__":
    sys.exit(main())
