"""The command line as an operator meets it: refusals exit 78 and name the problem."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
import tomllib
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import cv2
import numpy as np
import pytest
import zmq
from daemon import RunningDaemon, edged_command, free_port, run_cli, write_config
from onnx_models import colour_probe, nan_probe

from edged.cli import _parser, main
from edged.config import PublishConfig, TriggerConfig
from edged.messages import Verdict, VerdictMessage, schema_text
from edged.tools.reference import reference_text
from edged.trigger import Request, TriggerServer

ROOT = Path(__file__).parent.parent

pytestmark = pytest.mark.integration


def _config(tmp: Path, model: dict | None = None, **sections: dict) -> Path:
    doc = {
        "model": model or {"path": "probe.onnx"},
        "publish": {"endpoints": ["tcp://127.0.0.1:0"]},
        "thermal": {"enabled": False},
    }
    doc.update(sections)
    return write_config(tmp / "edged.toml", doc)


def parsed(*args: str) -> tuple[int, str, str]:
    """`edged ARGS` in this process: its exit code, stdout and stderr. For what ends while the
    arguments are read (help, an option out of range), where an `edged` process would spend a
    second of CPU starting up; the commands that run are tested as processes."""
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else int(e.code is not None)
    return code, out.getvalue(), err.getvalue()


@pytest.fixture
def tmp(tmp_path: Path) -> Path:
    colour_probe(tmp_path / "probe.onnx")
    return tmp_path


def test_check_reports_contract_head_and_placement(tmp: Path) -> None:
    result = run_cli("check", "--config", str(_config(tmp)))
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "input      images [1, 3, 64, 64] float32 nchw rgb (declared: model.channel_order's default) letterbox" in out
    assert "yolov8 head, 2 classes: red, blue" in out
    assert "placement  CPUExecutionProvider:" in out and " nodes" in out
    assert "from ONNX Runtime's" in out  # the assignment record, or the profile where this onnxruntime has none
    assert "one per physical core of" in next(line for line in out.splitlines() if line.startswith("threads    "))
    assert out.rstrip().endswith("ok")


def test_check_warns_about_more_threads_than_the_process_has_cpus(tmp: Path) -> None:
    threads = len(os.sched_getaffinity(0)) + 1
    result = run_cli("check", "--config", str(_config(tmp, runtime={"intra_op_threads": threads})))
    assert result.returncode == 0, result.stderr
    assert f"threads    {threads}, as configured" in result.stdout
    assert f"warning: runtime.intra_op_threads = {threads} but this process may use only" in result.stdout


def test_check_warns_about_a_provider_this_build_lacks(tmp: Path) -> None:
    path = _config(tmp)
    path.write_text(
        path.read_text() + '\n[[runtime.providers]]\nname = "TensorrtExecutionProvider"\n'
        '[[runtime.providers]]\nname = "CPUExecutionProvider"\n'
    )
    result = run_cli("check", "--config", str(path))
    assert result.returncode == 0, result.stderr
    assert "TensorrtExecutionProvider is not in this onnxruntime build" in result.stdout
    assert "session uses: CPUExecutionProvider" in result.stdout


def test_check_opens_the_source_and_reports_its_size_rate_and_channel_order(tmp: Path) -> None:
    source = {"type": "synthetic", "width": 160, "height": 96, "fps": 20.0}
    result = run_cli("check", "--config", str(_config(tmp, source=source)))
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert next(line for line in lines if line.startswith("source     ")).startswith("source     synthetic width=160")
    delivers = next(line for line in lines if "delivers" in line)
    assert delivers.startswith("           delivers 160x96 at ") and delivers.endswith(
        " fps (measured), channel order bgr (declared: source.channel_order)"
    )
    assert float(delivers.split(" at ")[1].split()[0]) == pytest.approx(20.0, rel=0.3)


def test_check_refuses_a_video_file_that_does_not_exist(tmp: Path) -> None:
    result = run_cli("check", "--config", str(_config(tmp, source={"type": "file", "path": "absent.mp4"})))
    assert result.returncode == 78
    assert "absent.mp4 does not exist" in result.stderr


def test_config_errors_never_show_a_camera_password(tmp: Path) -> None:
    source = {"type": "rtsp", "url": "http://viewer:s3cret@camera.local/stream"}
    result = run_cli("check", "--config", str(_config(tmp, source=source)))
    assert result.returncode == 78
    assert "source.url: Value error, must be an rtsp:// or rtsps:// URL" in result.stderr
    assert "http://***@camera.local/stream" in result.stderr and "s3cret" not in result.stderr


def test_check_refuses_a_normalisation_that_makes_scores_above_one(tmp: Path) -> None:
    # scale 1 instead of 1/255: the probe's score on a grey 114 frame becomes 114.
    result = run_cli("check", "--config", str(_config(tmp, {"path": "probe.onnx", "scale": 1.0})))
    assert result.returncode == 78
    assert "score(s) above 1" in result.stderr and "model.scale" in result.stderr


@pytest.mark.parametrize(("colour", "refused"), [((255, 255, 255), True), ((0, 0, 255), False)])
def test_check_refuses_a_model_whose_output_on_the_cameras_first_frame_is_nan(
    tmp: Path, colour: tuple[int, int, int], refused: bool
) -> None:
    # The model gives NaN on bright frames only: the grey frame passes, the camera's white one does not.
    nan_probe(tmp / "nan.onnx")
    (tmp / "imgs").mkdir()
    cv2.imwrite(str(tmp / "imgs" / "frame.png"), np.full((96, 128, 3), colour, np.uint8))
    source = {"type": "images", "path": str(tmp / "imgs")}
    result = run_cli("check", "--config", str(_config(tmp, {"path": "nan.onnx"}, source=source)))
    if refused:
        assert result.returncode == 78, result.stdout
        assert "the camera's first frame gave 48 NaN or infinite output value(s)" in result.stderr
    else:
        assert result.returncode == 0, result.stderr


def _model(tmp: Path, name: str, **kwargs: object) -> str:
    colour_probe(tmp / name, **kwargs)  # type: ignore[arg-type]
    return name


@pytest.mark.parametrize("command", ["run", "check"])
@pytest.mark.parametrize(
    ("setup", "message"),
    [
        # unknown config key, with its path and a hint
        (
            lambda t: _config(t, {"path": "probe.onnx", "confidence": 0.5}),
            "model.confidence: Extra inputs are not permitted (unknown key",
        ),
        # out-of-range value
        (lambda t: _config(t, {"path": "probe.onnx", "iou": 1.5}), "model.iou: Input should be less than or equal to 1"),
        # wrong type
        (lambda t: _config(t, {"path": "probe.onnx", "max_det": "many"}), "model.max_det: Input should be a valid integer"),
        # missing model file
        (lambda t: _config(t, {"path": "nowhere.onnx"}), "model file"),
        # corrupt model file
        (
            lambda t: (t / "bad.onnx").write_bytes(b"\x08\x07garbage") and _config(t, {"path": "bad.onnx"}),
            "onnxruntime cannot load",
        ),
        # a fixed batch of 4
        (lambda t: _config(t, {"path": _model(t, "b4.onnx", batch=4)}), "fixed batch of 4"),
        # declared layout contradicts the model
        (lambda t: _config(t, {"path": "probe.onnx", "layout": "nhwc"}), "config model.layout says NHWC"),
        # RGB/BGR contradiction between config and model metadata
        (
            lambda t: _config(t, {"path": _model(t, "bgr.onnx", metadata={"color_order": "bgr"}), "channel_order": "rgb"}),
            "color_order = 'bgr'",
        ),
        # rgb declared on a source whose frames OpenCV decodes
        (
            lambda t: _config(t, source={"type": "images", "path": str(t), "channel_order": "rgb"}),
            "'rgb' cannot be right for source type 'images': OpenCV decodes its frames",
        ),
        # an evidence folder that is a file
        (lambda t: _config(t, evidence={"dir": "probe.onnx"}), "evidence.dir: {tmp}/probe.onnx is a file"),
        # head declared wrongly
        (lambda t: _config(t, {"path": "probe.onnx", "head": "yolov5"}), "model.head = 'yolov5'"),
        # not TOML at all
        (lambda t: (t / "edged.toml").write_text("[model\npath=") and t / "edged.toml", "not valid TOML"),
    ],
)
def test_refusals_exit_78_and_name_the_problem(tmp: Path, command: str, setup, message: str) -> None:
    path = setup(tmp)
    result = run_cli(command, "--config", str(path))
    assert result.returncode == 78, (result.stdout, result.stderr)
    assert message.format(tmp=tmp) in result.stderr + result.stdout


def test_every_config_problem_is_listed_at_once(tmp: Path) -> None:
    path = _config(tmp, {"path": "probe.onnx", "iou": 2, "conf": -1}, service={"log_level": "loud"})
    result = run_cli("check", "--config", str(path))
    assert result.returncode == 78
    for key in ("model.iou", "model.conf", "service.log_level"):
        assert key in result.stderr
    assert "3 problem(s)" in result.stderr


def test_missing_config_file_says_so(tmp: Path) -> None:
    result = run_cli("run", "--config", str(tmp / "absent.toml"))
    assert result.returncode == 78
    assert "does not exist" in result.stderr


def test_environment_overrides_the_file(tmp: Path) -> None:
    result = run_cli("check", "--config", str(_config(tmp)), env={"EDGED_MODEL__IOU": "7"})
    assert result.returncode == 78 and "model.iou" in result.stderr
    assert "(from the environment: EDGED_MODEL__IOU)" in result.stderr


@pytest.mark.parametrize("command", ["run", "check"])
def test_a_directory_at_the_config_path_exits_78_naming_it(tmp: Path, command: str) -> None:
    result = run_cli(command, "--config", str(tmp))
    assert result.returncode == 78, result.stderr
    assert f"config file {tmp} is a directory, not a file" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_misspelt_variable_is_warned_about_and_the_check_goes_on(tmp: Path) -> None:
    result = run_cli("check", "--config", str(_config(tmp)), env={"EDGED_MODLE__CONF": "0.9"})
    assert result.returncode == 0, result.stderr
    assert "environment variable EDGED_MODLE__CONF sets nothing: no section 'modle'; did you mean EDGED_MODEL__CONF?" in (
        result.stderr
    )


def test_schema_command_prints_the_generated_schema(tmp: Path) -> None:
    result = run_cli("schema")
    assert result.returncode == 0
    assert result.stdout == schema_text()
    assert json.loads(result.stdout)["title"] == "edged messages"


def test_config_reference_command_prints_and_writes_the_generated_reference(tmp: Path) -> None:
    result = run_cli("config-reference")
    assert result.returncode == 0, result.stderr
    assert result.stdout == reference_text()
    written = run_cli("config-reference", "--out", str(tmp / "configuration.md"))
    assert written.returncode == 0 and written.stdout == "", written.stderr
    assert (tmp / "configuration.md").read_text() == reference_text()


def _asked(server: TriggerServer, camera_id: str, proc: subprocess.Popen[str]) -> Request:
    """The request ``proc`` sends, read as the daemon loop reads them."""
    while (request := server.next(camera_id)) is None:
        assert proc.poll() is None, proc.communicate()
        if zmq.select(server.fds, [], [], 30)[0]:
            server.collect()
    return request


def _reply_to_side_p1(
    server: TriggerServer, endpoint: str, camera_id: str, part_id: str | None, verdict: Verdict
) -> tuple[int, str, str]:
    """`edged trigger --camera side --part-id P-1` against ``server``, answered with a ``verdict`` of
    camera ``camera_id`` for ``part_id``: its exit status, stdout and stderr."""
    command = edged_command("trigger", endpoint, "--camera", "side", "--part-id", "P-1", "--timeout", "30")
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        request = _asked(server, "side", proc)
        assert (request.camera_id, request.part_id) == ("side", "P-1") and server.next("top") is None
        reply = VerdictMessage(
            camera_id=camera_id,
            seq=0,
            frame_id=7,
            capture_time_ns=1,
            part_id=part_id,
            verdict=verdict,
            reasons=[],
            verdict_latency_ms=1,
        )
        server.answer(request, reply)
        out, err = proc.communicate(timeout=60)
    return proc.returncode, out, err


def test_trigger_asks_for_the_camera_it_is_given(tmp_path: Path) -> None:
    endpoint = f"ipc://{tmp_path / 'trigger.sock'}"
    server = TriggerServer(TriggerConfig(mode="request", endpoint=endpoint), PublishConfig(), ["top", "side"])
    try:
        code, out, err = _reply_to_side_p1(server, endpoint, "side", "P-1", "ng")
        assert code == 3, err
        assert "[verdict side frame 7 part P-1] NG" in out
        unnamed = edged_command("trigger", endpoint, "--timeout", "30")
        with subprocess.Popen(unnamed, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
            while proc.poll() is None:
                if zmq.select(server.fds, [], [], 1)[0]:
                    server.collect()  # answers it at once
            err = proc.communicate()[1]
        assert proc.returncode == 1, err
        assert "no verdict (bad_request): name the camera: camera_id '' does not take requests here" in err
        assert "the cameras that do: top, side" in err
    finally:
        server.close()
    refused = run_cli("trigger", endpoint, "--camera", "top side", "--timeout", "1")
    assert refused.returncode == 2 and "--camera: String should match pattern" in refused.stderr, refused.stderr


def test_trigger_refuses_a_part_id_with_a_control_or_format_character_before_sending(tmp_path: Path) -> None:
    endpoint = f"ipc://{tmp_path / 'nobody.sock'}"  # nothing listens: the refusal comes first
    for part_id, named in (("A\nOK", "U+000A"), ("A-\u202eGN", "U+202E")):
        refused = run_cli("trigger", endpoint, "--part-id", part_id, "--timeout", "1")
        assert refused.returncode == 2 and f"--part-id: {named} at character" in refused.stderr, refused.stderr
        assert part_id not in refused.stderr


@pytest.mark.parametrize(
    ("camera_id", "part_id", "said"),
    [
        ("top", "P-1", "for camera top part P-1, not camera side part P-1"),
        ("side", "P-2", "for camera side part P-2, not camera side part P-1"),
        ("side", None, "for camera side part (none), not camera side part P-1"),
    ],
)
def test_trigger_refuses_a_reply_that_is_not_for_its_request(
    tmp_path: Path, camera_id: str, part_id: str | None, said: str
) -> None:
    endpoint = f"ipc://{tmp_path / 'trigger.sock'}"
    server = TriggerServer(TriggerConfig(mode="request", endpoint=endpoint), PublishConfig(), ["top", "side"])
    try:
        code, out, err = _reply_to_side_p1(server, endpoint, camera_id, part_id, "ok")
        assert code == 1, (out, err)
        assert out == "" and f"the reply from {endpoint} is {said}" in err, err
    finally:
        server.close()


@pytest.mark.parametrize(
    "command",
    [
        "run",
        "check",
        "subscribe",
        "schema",
        "config-reference",
        "thermal",
        "eval",
        "keygen",
        "sign",
        "bench",
        "quantize",
        "tune",
        "trigger",
    ],
)
def test_every_command_has_useful_help(command: str) -> None:
    code, out, _ = parsed(command, "--help")
    assert code == 0
    assert len(out.splitlines()) >= 4


@pytest.mark.parametrize(
    "args",
    [
        ["eval", "--model", "m.onnx", "--scenes", "1", "--json", "{out}"],
        ["quantize", "--model", "m.onnx", "--out", "{out}"],
        ["quantize", "--model", "m.onnx", "--out", "m.int8.onnx", "--report", "{out}"],
        ["tune", "--config", "edged.toml", "--out", "{out}"],
        ["sign", "m.onnx", "--key", "k.pem", "--out", "{out}"],
        ["schema", "--out", "{out}"],
        ["config-reference", "--out", "{out}"],
    ],
)
def test_a_file_to_write_in_a_missing_folder_a_folder_or_a_pipe_is_refused_before_any_work(
    tmp_path: Path, args: list[str]
) -> None:
    missing = tmp_path / "no-such-folder" / "out.json"
    code, _, err = parsed(*(a.format(out=missing) for a in args))
    assert code == 2 and f"no folder {missing.parent} to write out.json in" in err
    code, _, err = parsed(*(a.format(out=tmp_path) for a in args))
    assert code == 2 and f"{tmp_path} is a folder" in err
    os.mkfifo(tmp_path / "pipe")  # written once the work was done, it held the command up for ever
    code, _, err = parsed(*(a.format(out=tmp_path / "pipe") for a in args))
    assert code == 2 and f"{tmp_path / 'pipe'} is not a regular file" in err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["thermal", "--watch", "--interval", "0"], "--interval: must be above 0 and at most 600 s, got 0"),  # a tight loop
        (["thermal", "--watch", "--interval", "1e300"], "--interval: must be above 0 and at most 600 s"),  # overflowed sleep
        (["subscribe", "tcp://127.0.0.1:1", "--timeout", "-1"], "--timeout: must be above 0 and at most 86400 s"),
        (["subscribe", "tcp://127.0.0.1:1", "--count", "0"], "--count: must be >= 1"),
        (["trigger", "tcp://127.0.0.1:1", "--timeout", "0"], "--timeout: must be above 0 and at most 86400 s"),
        (["promote", "--timeout", "nan"], "--timeout: must be a finite number, got nan"),
        (["rollback", "--timeout", "inf"], "--timeout: must be a finite number"),
        (
            ["promote", "--timeout", "1e9"],
            "--timeout: must be above 0 and at most 86400 s, got 1e9",
        ),  # overflowed zmq's poll
        (["rollback", "--timeout", "3e6"], "--timeout: must be above 0 and at most 86400 s"),
        (["trigger", "tcp://127.0.0.1:1", "--timeout", "1e9"], "--timeout: must be above 0 and at most 86400 s"),
        (["subscribe", "tcp://127.0.0.1:1", "--timeout", "1e12"], "--timeout: must be above 0 and at most 86400 s"),
        (["tune", "--config", "c.toml", "--max-flips", "-1"], "--max-flips: must be >= 0"),
        (["tune", "--config", "c.toml", "--max-map-drop", "-5"], "--max-map-drop: must be >= 0"),
        (["bench", "--conf", "5"], "--conf: must be above 0 and at most 1, got 5"),
        (["bench", "--camera-fps", "0"], "--camera-fps: must be > 0"),
        (["bench", "--seconds", "-1"], "--seconds: must be > 0"),
        (["bench", "--warmup-s", "-1"], "--warmup-s: must be >= 0"),
        (["bench", "--abuse-s", "0"], "--abuse-s: must be > 0"),
        (["bench", "--cameras", "2", "17"], "--cameras: must be from 1 to 16, got 17"),
        (["bench", "--journal", "--journal-dir", "/nonexistent"], "--journal-dir: no folder /nonexistent"),
        (["eval", "--model", "m.onnx", "--scenes", "1", "--seed", "-1"], "--seed: must be >= 0"),
        (["eval", "--model", "m.onnx", "--scenes", "1", "--report-conf", "0"], "--report-conf: must be above 0"),
        (["calibrate", "--frames", "0"], "--frames: must be >= 1"),
        (["tune", "--config", "c.toml", "--frames", "0"], "--frames: must be >= 1"),
        (["tune", "--config", "c.toml", "--max-images", "0"], "--max-images: must be >= 1"),
        (["quantize", "--model", "m.onnx", "--out", "q.onnx", "--calib-scenes", "0"], "--calib-scenes: must be >= 1"),
        (["quantize", "--model", "m.onnx", "--out", "q.onnx", "--eval-scenes", "-1"], "--eval-scenes: must be >= 0"),
        (["quantize", "--model", "m.onnx", "--out", "q.onnx", "--latency-frames", "-1"], "--latency-frames: must be >= 0"),
        (["subscribe", "notanendpoint"], "'notanendpoint' is not an address to connect to: tcp://HOST:PORT"),
        (["trigger", "tcp://::::"], "'tcp://::::' is not an address to connect to"),
        (["thermal", "--root", "/nonexistent"], "--root: no folder /nonexistent"),
    ],
)
def test_options_out_of_range_exit_2_naming_the_option(args: list[str], message: str) -> None:
    code, _, err = parsed(*args)
    assert code == 2 and message in err, err


@pytest.mark.parametrize(
    ("reason", "message"),
    [
        (None, "--force needs --reason TEXT"),
        ("", "--force needs --reason TEXT"),
        ("fixture\nWARNING rolled back", "in --reason, U+000A at character 8 is a control character: say it on one line"),
    ],
)
def test_a_promotion_the_daemon_would_refuse_for_its_arguments_is_refused_at_once(
    tmp: Path, reason: str | None, message: str
) -> None:
    """``edged promote --force`` without ``--reason``, or with one that is not on one line: only the
    daemon refused it, so with none running the user waited out ``--timeout`` to hear nothing answered."""
    control = tmp / "control.sock"  # no edged listens on it
    config = _config(
        tmp, {"path": "probe.onnx"}, **{"model.candidate": {"path": "probe.onnx", "control": f"ipc://{control}"}}
    )
    started = time.monotonic()
    given = ["--reason", reason] if reason is not None else []
    code, out, err = parsed("promote", "--config", str(config), "--force", *given)
    assert (code, out) == (2, "") and message in err, err
    assert time.monotonic() - started < 2 and "no answer" not in err  # its --timeout is 10 s


@pytest.mark.parametrize(
    "command",
    [
        ["history", "--journal", "j.db"],
        ["trigger", "tcp://127.0.0.1:1"],
        ["tune", "--config", "c.toml"],
        ["quantize", "--model", "m.onnx", "--out", "q.onnx"],
    ],
)
def test_a_camera_id_starting_with_a_dash_is_taken_joined_and_the_message_says_so(command: list[str]) -> None:
    """``[[source]] camera_id = "-a"`` is a valid camera: ``--camera -a`` reads as ``--camera`` without
    its value and an option ``-a``, which argparse said as "expected one argument", and no more."""
    code, _, err = parsed(*command, "--camera", "-a")
    assert code == 2 and "argument --camera: expected one argument" in err, err
    assert err.rstrip().endswith("a value that starts with '-' is given joined by '=': --camera=-a"), err
    code, _, err = parsed(*command, "--cam", "-a")  # shortened, as argparse takes it
    assert code == 2 and err.rstrip().endswith("joined by '=': --camera=-a"), err
    assert _parser().parse_args([*command, "--camera=-a"]).camera == "-a"
    code, _, err = parsed(*command, "--camera")
    assert code == 2 and err.rstrip().endswith("argument --camera: expected one argument"), err
    code, _, err = parsed("history", "--part-id", "-x*")  # any option's value: quoted for the shell where it must be
    assert code == 2 and err.rstrip().endswith("joined by '=': '--part-id=-x*'"), err


def test_eval_refuses_zero_scenes() -> None:
    code, _, err = parsed("eval", "--model", "m.onnx", "--scenes", "0")
    assert code == 2 and "--scenes: must be >= 1, got 0" in err


@pytest.mark.parametrize(
    ("board", "expected"),
    [
        ("rpi4", ["state       ok", "raspberrypi (Raspberry Pi 4 Model B", "cpu-thermal", "under_voltage_occurred"]),
        ("jetson_orin", ["jetson (NVIDIA Jetson AGX Orin", "tj-thermal", "gpu-thermal         offline"]),
        ("none", ["state       unknown"]),
    ],
)
def test_thermal_command_reads_a_board_tree(tmp_path: Path, board: str, expected: list[str]) -> None:
    root = Path(__file__).parent / "fixtures" / "thermal" / board
    result = run_cli("thermal", "--root", str(root), "--config", str(tmp_path / "none.toml"))
    assert result.returncode == 0, result.stderr
    for text in expected:
        assert text in result.stdout, result.stdout


def test_run_started_with_its_standard_descriptors_closed_keeps_its_files_off_them(tmp: Path) -> None:
    """``edged run 0<&- 1>&- 2>&-``: the daemon's own files took descriptors 0 to 2 (a socket became
    its standard error), where FFmpeg, ONNX Runtime and libzmq write what they say, into the journal's
    database should it open first. They are /dev/null now."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    config = write_config(
        tmp / "edged.toml",
        {
            "source": {"type": "synthetic", "width": 128, "height": 96, "fps": 10},
            "model": {"path": "probe.onnx"},
            "publish": {"endpoints": [endpoint], "status_interval_s": 0.5},
            "thermal": {"enabled": False},
        },
    )
    d = RunningDaemon(config, endpoint, wrap=lambda argv: ["bash", "-c", 'exec "$@" 0<&- 1>&- 2>&-', "edged", *argv])
    try:
        d.collect("detections", 1)
        fds = {int(fd): os.readlink(f"/proc/{d.proc.pid}/fd/{fd}") for fd in os.listdir(f"/proc/{d.proc.pid}/fd")}
        assert [fds[fd] for fd in (0, 1, 2)] == [os.devnull] * 3, fds
    finally:
        d.close()


@pytest.mark.parametrize("command", [["schema"], ["check", "--config", "edged.toml"], ["config-reference"]])
def test_a_reader_gone_before_the_output_ends_it_quietly(tmp: Path, command: list[str]) -> None:
    """`edged check | head -1`, `edged schema | true`: a BrokenPipeError traceback, exit 1 (or, for a
    command whose output waits in its buffer, Python's own complaint at exit, 120). The reader has
    what it wanted: exit 0, nothing said."""
    _config(tmp)
    proc = subprocess.Popen(edged_command(*command), cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # before the command has written anything: Python is still starting
    err = proc.stderr.read()
    proc.stderr.close()
    assert (proc.wait(60), err) == (0, "")


def _loaded(pid: int, library: str) -> bool:
    """Whether process ``pid`` has mapped a file whose name holds ``library`` (/proc's maps)."""
    try:
        return library in Path(f"/proc/{pid}/maps").read_text()
    except OSError:  # gone
        return True


@pytest.mark.parametrize(
    ("how", "args", "code"),
    [
        ("module", ("trigger", "tcp://127.0.0.1:9"), 128 + signal.SIGINT),
        ("command", ("trigger", "tcp://127.0.0.1:9"), 128 + signal.SIGINT),
        # Ctrl-C is how subscribe is ended, exit 0 once it runs: it was 130 while it loaded
        ("command", ("subscribe", "tcp://127.0.0.1:9"), 0),
    ],
)
def test_ctrl_c_while_the_command_loads_ends_it_quietly_as_one_while_it_runs(
    tmp_path: Path, how: str, args: tuple[str, ...], code: int
) -> None:
    """The first second on a small board goes to importing edged's modules, before the command's own
    handling of Ctrl-C: `python -m edged` ended with a traceback and exit 1, the installed command
    with a traceback. The signal is sent as pydantic's compiled core is loaded, as `edged.config`, one
    of `edged.cli`'s imports, is being imported."""
    entry = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]["edged"]
    module, function = entry.split(":")
    command = tmp_path / "edged"  # as pip writes the installed command
    command.write_text(f"import sys\nfrom {module} import {function}\nsys.exit({function}())\n")
    argv = edged_command(*args) if how == "module" else [sys.executable, str(command), *args]
    proc = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        deadline = time.monotonic() + 30
        while not _loaded(proc.pid, "_pydantic_core") and time.monotonic() < deadline:
            pass  # no sleep: the window is the imports' few hundred milliseconds
        proc.send_signal(signal.SIGSTOP)  # held there, however late this process looked
        proc.send_signal(signal.SIGINT)
        proc.send_signal(signal.SIGCONT)
        _, stderr = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == code, stderr
    assert stderr == "" if code == 0 else "Traceback" not in stderr and stderr.endswith(f"{args[0]} interrupted\n"), stderr


MODELS_BUILT_LATER = """
import importlib, json, pkgutil, pydantic, edged, edged.__main__

def models():
    seen, todo = set(), [pydantic.BaseModel]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub not in seen:
                seen.add(sub)
                todo.append(sub)
    return {f"{m.__module__}.{m.__qualname__}" for m in seen if m.__module__.startswith("edged")}

edged.__main__._command()
held = models()
for module in pkgutil.walk_packages(edged.__path__, "edged."):
    importlib.import_module(module.name)
print(json.dumps([sorted(held), sorted(models() - held)]))
"""


def test_every_pydantic_model_is_built_while_ctrl_c_is_held() -> None:
    """pydantic's core builds a model as its module is imported, and a KeyboardInterrupt raised inside
    it comes out as a SchemaError: a Ctrl-C as `edged subscribe` imported `edged.messages`, after the
    hold (a loaded machine, the name being looked up), ended it with a traceback and exit 1. Every
    model is built while Ctrl-C is held: importing each of edged's modules afterwards builds none."""
    proc = subprocess.run([sys.executable, "-c", MODELS_BUILT_LATER], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    held, later = json.loads(proc.stdout)
    assert {"edged.config.Settings", "edged.messages.DetectionsMessage"} <= set(held) and later == [], proc.stdout


def test_ctrl_c_while_the_command_loads_is_still_ignored_where_it_was(tmp_path: Path) -> None:
    """A command started with SIGINT ignored (``trap '' INT``, a script's background job) is not ended by
    a Ctrl-C as its modules load: it was, with exit 130, held there as if it had been wanted."""
    proc = subprocess.Popen(
        edged_command("schema"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )
    try:
        deadline = time.monotonic() + 30
        while not _loaded(proc.pid, "_pydantic_core") and time.monotonic() < deadline:
            pass  # no sleep: the window is the imports' few hundred milliseconds
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert (proc.returncode, stderr) == (0, "")
    assert json.loads(stdout)
