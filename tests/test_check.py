"""``edged check`` as an operator runs it: what `run` will do, and every place `run` would fail, found first."""

from __future__ import annotations

import contextlib
import fcntl
import io
import os
import select
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import time
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from subprocess import PIPE

import cv2
import numpy as np
import pytest
from daemon import RunningDaemon, edged_command, free_port, run_cli, write_config, write_video
from filesystems import read_only_folder
from onnx_models import colour_probe

import edged.evidence
from edged.check import held_by_another, run_check
from edged.config import load_config
from edged.errors import ConfigError

pytestmark = pytest.mark.integration

TASKS = Path(__file__).parent / "data" / "tasks"


@pytest.fixture
def tmp(tmp_path: Path) -> Path:
    colour_probe(tmp_path / "probe.onnx")
    (tmp_path / "imgs").mkdir()
    cv2.imwrite(str(tmp_path / "imgs" / "red.png"), np.full((96, 128, 3), (0, 0, 200), np.uint8))  # BGR: red
    return tmp_path


def _config(tmp: Path, ports: list[int], name: str = "edged.toml", **sections: dict) -> Path:
    """An images camera showing red, every server on a port of ``ports``: publish, http, trigger."""
    doc: dict = {
        "source": {"type": "images", "path": str(tmp / "imgs")},
        "model": {"path": "probe.onnx"},
        "publish": {"endpoints": [f"tcp://127.0.0.1:{ports[0]}"]},
        "http": {"listen": f"127.0.0.1:{ports[1]}"},
        "trigger": {"mode": "request", "endpoint": f"tcp://127.0.0.1:{ports[2]}"},
        "thermal": {"enabled": False},
    }
    doc.update(sections)
    return write_config(tmp / name, doc)


@pytest.fixture
def ports() -> list[int]:
    return [free_port() for _ in range(3)]


@pytest.fixture
def held() -> Iterator[list[socket.socket]]:
    sockets: list[socket.socket] = []
    yield sockets
    for s in sockets:
        s.close()


def _hold(held: list[socket.socket], port: int) -> None:
    """Another program listening on ``port``, as it holds it."""
    s = socket.socket()
    s.bind(("127.0.0.1", port))
    s.listen()
    held.append(s)


def test_check_says_what_run_will_do_and_binds_every_address(tmp: Path, ports: list[int]) -> None:
    inspect = {
        "class_conf": {"red": 0.5, "1": 0.6},
        "ng_classes": ["red", "1"],
        "zones": {"all": [[0, 0], [1, 0], [1, 1], [0, 1]]},
    }
    evidence = tmp / "evidence"
    runtime = tmp / "run" / "edged"  # systemd's runtime directory, made when the service starts
    control = f"ipc://{runtime}/control.sock"
    candidate = {"candidate": {"path": "probe.onnx", "control": control, "evidence_dir": str(tmp / "disagreed")}}
    config = _config(
        tmp,
        ports,
        inspect=inspect,
        evidence={"dir": str(evidence), "save": "ng+near"},
        model={"path": "probe.onnx", **candidate},
    )
    result = run_cli("check", "--config", str(config), env={"RUNTIME_DIRECTORY": str(runtime)})
    assert result.returncode == 0, result.stdout + result.stderr
    lines = [line.strip() for line in result.stdout.splitlines()]
    assert lines[0] == f"config     {config}" and lines[-1] == "ok"
    assert "first frame: 1 detection(s): red 0.70; verdict ng" in lines
    assert (
        "inspect: thresholds model.conf 0.25, red 0.5, 1 (blue) 0.6; zones all (outside them: drop); "
        "NG classes: red, 1 (blue)" in lines
    )  # a class named by its id, with its label
    assert "trigger: request: one frame per request on trigger.endpoint" in lines
    assert f"evidence: ng+near frames to {evidence}/cam0 (a file created and removed there)" in lines
    assert not evidence.exists()  # made for the try, and removed: run makes it again
    assert f"the frames the models disagree on to {tmp / 'disagreed'} (a file created and removed there)" in result.stdout
    assert not (tmp / "disagreed").exists()
    # Made for the socket and removed: left, root's after `sudo edged check`, the service could make no
    # socket in it until systemd chowned it at the next start (and a second check said so).
    assert not (tmp / "run").exists()
    assert f"journal    {config.parent / 'journal.sqlite'}: the verdicts of cam0; durability normal" in lines
    for key, address in (
        ("publish.endpoints", f"tcp://127.0.0.1:{ports[0]}"),
        ("http.listen", f"http://127.0.0.1:{ports[1]}/"),
        ("trigger.endpoint", f"tcp://127.0.0.1:{ports[2]}"),
        ("model.candidate.control", control),
    ):
        assert f"listen     {key}: {address} (bound and released)" in result.stdout
    assert "valid" not in result.stdout


@pytest.mark.parametrize(
    ("index", "key", "named"),
    [
        (0, "publish.endpoints", "publish.endpoints: cannot bind tcp://127.0.0.1:{port}"),
        (1, "http.listen", "http.listen 127.0.0.1:{port}: the live view, status page and metrics cannot be served"),
        (2, "trigger.endpoint", "trigger.endpoint: cannot bind tcp://127.0.0.1:{port}"),
    ],
)
def test_a_port_in_use_fails_the_check_with_exit_1_naming_its_key_and_port(
    tmp: Path, ports: list[int], held: list[socket.socket], index: int, key: str, named: str
) -> None:
    _hold(held, ports[index])
    config = _config(tmp, ports)
    result = run_cli("check", "--config", str(config))
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"edged: check failed: {named.format(port=ports[index])}" in result.stderr, result.stderr
    assert "Address already in use" in result.stderr and "edged check --no-bind" in result.stderr
    assert "ok" not in result.stdout.splitlines()
    # Beside the running service, which holds its own ports, the rest is still checked.
    beside = run_cli("check", "--no-bind", "--config", str(config))
    assert beside.returncode == 0, beside.stdout + beside.stderr
    assert f"listen     {key}: " in beside.stdout and "(in use, by the running service perhaps: --no-bind)" in beside.stdout


@pytest.mark.parametrize("options", [(), ("--no-bind",)])
def test_the_same_port_twice_in_one_configuration_is_a_config_error_beside_the_service_too(
    tmp: Path, ports: list[int], options: tuple[str, ...]
) -> None:
    """Not another program's (exit 1, which ``--no-bind`` passes over): the configuration's own mistake."""
    config = _config(tmp, ports, http={"listen": f"127.0.0.1:{ports[0]}"})
    result = run_cli("check", *options, "--config", str(config))
    assert result.returncode == 78, result.stdout + result.stderr
    assert f"http.listen: '127.0.0.1:{ports[0]}' would listen where publish.endpoints" in result.stderr, result.stderr


@pytest.mark.parametrize(
    ("sections", "said"),
    [
        pytest.param(
            lambda tmp: {"evidence": {"dir": "/proc/edged-evidence"}},
            "evidence.dir: camera cam0's evidence cannot be saved in /proc/edged-evidence",
            id="evidence",
        ),
        pytest.param(  # check said ok, and the trial logged every frame it could not save
            lambda tmp: {
                "model": {
                    "path": "probe.onnx",
                    "candidate": {"path": "probe.onnx", "control": f"ipc://{tmp}/control.sock", "evidence_dir": "/proc/x"},
                }
            },
            "model.candidate.evidence_dir: the frames the models disagree on cannot be saved in /proc/x",
            id="candidate-disagreements",
        ),
    ],
)
def test_an_evidence_folder_that_takes_no_file_fails_the_check(
    tmp: Path, ports: list[int], sections: Callable[[Path], dict], said: str
) -> None:
    config = _config(tmp, ports, **sections(tmp))
    result = run_cli("check", "--config", str(config))
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"edged: check failed: {said}" in result.stderr
    assert "that filesystem takes no files" in result.stderr


def test_a_problem_found_after_loading_is_one_verdict_naming_the_file(tmp: Path, ports: list[int]) -> None:
    config = _config(tmp, ports, inspect={"ng_classes": ["crack"]})  # the probe's classes are red and blue
    result = run_cli("check", "--config", str(config))
    assert result.returncode == 78, result.stdout + result.stderr
    assert f"edged: configuration error: 1 problem(s) in {config}:" in result.stderr
    assert "valid" not in result.stdout and "ok" not in result.stdout.splitlines()


def test_a_candidate_that_will_not_load_fails_the_check_naming_it(tmp: Path, ports: list[int]) -> None:
    (tmp / "notes.txt").write_text("not a model\n")
    colour_probe(tmp / "next.onnx")
    control = f"ipc://{tmp / 'control.sock'}"
    config = _config(tmp, ports, model={"path": "probe.onnx", "candidate": {"path": "next.onnx", "control": control}})
    result = run_cli("check", "--config", str(config))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"candidate  {tmp / 'next.onnx'} (next@" in result.stdout
    config = _config(tmp, ports, model={"path": "probe.onnx", "candidate": {"path": "notes.txt", "control": control}})
    result = run_cli("check", "--config", str(config))
    assert result.returncode == 78, result.stdout + result.stderr
    assert "model.candidate.path: the candidate does not load" in result.stderr
    assert "notes.txt" in result.stderr and "the live model would go on alone" in result.stderr
    assert "ok" not in result.stdout.splitlines()


def test_an_anomaly_models_inspection_is_said_in_its_own_terms(tmp: Path, ports: list[int]) -> None:
    model = Path(__file__).parent / "data" / "anomaly" / "padim.onnx"
    inspect = {"zones": {"left": [(0, 0), (0.5, 0), (0.5, 1), (0, 1)]}}
    config = _config(tmp, ports, model={"path": str(model), "anomaly_threshold": 0.31}, inspect=inspect)
    result = run_cli("check", "--config", str(config))
    assert result.returncode == 0, result.stdout + result.stderr
    lines = [line.strip() for line in result.stdout.splitlines()]
    assert (
        "inspect: anomaly score above model.anomaly_threshold 0.31; zones left (regions outside them count for nothing)"
        in lines
    )


def test_a_candidate_of_another_task_fails_the_check_naming_both(tmp: Path, ports: list[int]) -> None:
    control = f"ipc://{tmp / 'control.sock'}"
    candidate = {"path": str(Path(__file__).parent / "data" / "tasks" / "cls.onnx"), "control": control}
    config = _config(tmp, ports, model={"path": "probe.onnx", "candidate": candidate})
    result = run_cli("check", "--config", str(config))
    assert result.returncode == 78, result.stdout + result.stderr
    assert "model.candidate.path: the candidate is a classify model and the live model a detect model" in result.stderr


def test_a_classifier_roi_outside_the_cameras_frames_fails_the_check_naming_it(tmp: Path, ports: list[int]) -> None:
    model = Path(__file__).parent / "data" / "tasks" / "cls.onnx"
    inspect = {"ng_classes": ["crack"], "roi": [10, 10, 120, 90]}  # the camera's frames are 128x96
    config = _config(tmp, ports, model={"path": str(model)}, inspect=inspect)
    result = run_cli("check", "--config", str(config))
    assert result.returncode == 0, result.stdout + result.stderr
    config = _config(tmp, ports, model={"path": str(model)}, inspect={**inspect, "roi": [200, 10, 300, 50]})
    result = run_cli("check", "--config", str(config))
    assert result.returncode == 78, result.stdout + result.stderr  # run rejected every frame
    assert "inspect.roi [200, 10, 300, 50] does not fit in a 128x96 frame" in result.stderr


def test_the_default_evidence_folder_outside_systemd_is_beside_the_configuration(
    tmp: Path, ports: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("STATE_DIRECTORY", raising=False)
    config = _config(tmp, ports, evidence={"save": "all"})
    result = run_cli("check", "--config", str(config))
    assert result.returncode == 0, result.stdout + result.stderr
    assert (
        f"evidence: all frames to {tmp}/evidence/cam0 (the default: evidence.dir is not set) "
        "(a file created and removed there)" in result.stdout
    )


def test_the_cameras_are_opened_at_once_not_one_after_the_other(tmp: Path) -> None:
    """Two cameras whose streams (GStreamer's TCP client) connect and never send: the second is
    connected to while the first still waits for its first frame, not once the first has given up.
    One after the other, a board of several hung cameras waited out each one's open_timeout_s in
    turn. (GStreamer, not RTSP: OpenCV's FFmpeg captures open one at a time in any case.)"""
    with contextlib.ExitStack() as stack:
        listeners = []
        for _ in range(2):
            listener = stack.enter_context(socket.socket())
            listener.bind(("127.0.0.1", 0))
            listener.listen(8)
            listeners.append(listener)
        cameras = [
            {
                "type": "gstreamer",
                "camera_id": f"cam{i}",
                "pipeline": f"tcpclientsrc host=127.0.0.1 port={s.getsockname()[1]} ! jpegdec",
                "open_timeout_s": 4.0,
            }
            for i, s in enumerate(listeners)
        ]
        config = write_config(
            tmp / "edged.toml", {"source": cameras, "model": {"path": "probe.onnx"}, "thermal": {"enabled": False}}
        )
        proc = subprocess.Popen(edged_command("check", "--config", str(config)), stdout=PIPE, stderr=PIPE, text=True)
        stack.callback(proc.kill)
        accepted: dict[socket.socket, socket.socket] = {}
        deadline = time.monotonic() + 60
        while len(accepted) < 2:
            waiting = [s for s in listeners if s not in accepted]
            readable, _, _ = select.select([*waiting, *accepted.values()], [], [], max(0.0, deadline - time.monotonic()))
            assert readable, f"no camera connected within 60 s: {proc.poll()}"
            for s in readable:
                if s in listeners:
                    accepted[s] = stack.enter_context(s.accept()[0])
                else:  # the end, when the camera gives up
                    assert s.recv(4096) != b"", "a camera gave up before the other was connected to"
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 1, out + err
        assert "2 of 2 cameras gave no frame (cam0, cam1)" in err


def test_a_journal_another_edged_holds_fails_the_check_as_it_stops_run(tmp: Path, ports: list[int]) -> None:
    """Run refuses to share a journal with another edged (exit 78); check said ok. Nobody holding it,
    check leaves no lock file behind: one root's `sudo edged check` made, the service could not open."""
    journal = tmp / "journal.sqlite"
    config = _config(tmp, ports, inspect={"ng_classes": ["red"]}, journal={"path": str(journal)}, trigger={})
    result = run_cli("check", "--config", str(config))
    assert result.returncode == 0, result.stdout + result.stderr
    assert not Path(f"{journal}.lock").exists()
    held = f"journal.path {journal} is in use by another edged (its lock {journal}.lock is held)"
    fd = os.open(f"{journal}.lock", os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        for command in ("check", "run"):
            result = run_cli(command, "--config", str(config))
            assert result.returncode == 78, f"{command}: {result.stdout}{result.stderr}"
            assert held in result.stderr, f"{command}: {result.stderr}"
        assert _checked_beside(config) == 0  # a holder that runs no `edged run`: perhaps the service, passed over
    finally:
        os.close(fd)
    # Beside another edged, run on another configuration that names the same journal, --no-bind said ok too.
    other_ports = [free_port() for _ in range(3)]
    other = _config(
        tmp, other_ports, "other.toml", inspect={"ng_classes": ["red"]}, journal={"path": str(journal)}, trigger={}
    )
    daemon = RunningDaemon(other, f"tcp://127.0.0.1:{other_ports[0]}")
    try:
        daemon.collect("verdict", 1)  # recorded: the journal is open, its lock held
        with pytest.raises(ConfigError) as refused:
            _checked_beside(config)
        assert (
            f"journal.path {journal} is held by another edged (process {daemon.proc.pid}, running {other}): "
            "give each edged a journal.path of its own" in str(refused.value)
        ), refused.value
        assert _checked_beside(other) == 0  # its own
        with pytest.raises(ConfigError) as refused:  # as run refuses to start: the holder named
            run_check(config, load_config(config), None, io.StringIO())
        assert f"is held) by process {daemon.proc.pid} (" in str(refused.value), refused.value
        assert f"edged run --config {other}):" in str(refused.value), refused.value
    finally:
        daemon.close()


def _checked_beside(config: Path) -> int:
    """``edged check --no-bind --config CONFIG``'s exit code, run in this process."""
    return run_check(config, load_config(config), None, io.StringIO(), bind=False)


@pytest.mark.skipif(os.geteuid() != 0, reason="only root gives a folder to another user, as systemd does")
@pytest.mark.parametrize("taken_during", ["write_atomic", "shared_with"])  # the file tried there; the folders compared
def test_an_evidence_folder_given_to_the_service_during_the_check_is_left_to_it(
    tmp: Path, ports: list[int], monkeypatch: pytest.MonkeyPatch, taken_during: str
) -> None:
    """``sudo edged check --no-bind`` while the service starts: the evidence folders the check made for
    its try, which the service has made its own since (systemd gave the state directory to its user),
    were removed under it."""
    evidence = tmp / "evidence"
    config = _config(tmp, ports, evidence={"dir": str(evidence)})
    real = getattr(edged.evidence, taken_during)

    def taken(*args: object) -> object:
        for folder in (evidence, evidence / "cam0"):
            os.chown(folder, 65534, 65534)
        return real(*args)

    monkeypatch.setattr(edged.evidence, taken_during, taken)
    assert _checked_beside(config) == 0
    assert [(p.name, p.stat().st_uid) for p in (evidence, *evidence.iterdir())] == [
        ("evidence", 65534),
        ("cam0", 65534),
    ]


def test_a_journal_folder_that_takes_no_file_fails_the_check_with_exit_1(tmp: Path, ports: list[int]) -> None:
    """Run serves and records no verdict; check said ok. Now it says so, exit 1 as for evidence."""
    folder = tmp / "journal"
    config = _config(
        tmp, ports, inspect={"ng_classes": ["red"]}, journal={"path": str(folder / "journal.sqlite")}, trigger={}
    )
    with read_only_folder(folder):
        result = run_cli("check", "--config", str(config))
        assert result.returncode == 1, result.stdout + result.stderr
        assert f"journal.path: {folder}/journal.sqlite cannot be written: " in result.stderr
        assert "run would record no verdict" in result.stderr
        daemon = RunningDaemon(config, f"tcp://127.0.0.1:{ports[0]}")
        try:
            assert daemon.collect("verdict", 1)[0].verdict == "ng"  # run serves all the same
        finally:
            daemon.close()


def test_an_opcua_cert_dir_that_takes_no_file_fails_the_check_with_exit_1(tmp: Path, ports: list[int]) -> None:
    """Run serves every other output and retries the certificate; check said ok. Now it says so, exit 1."""
    users = tmp / "users"
    users.write_text("operator:a-password-long-enough\n")
    users.chmod(0o600)
    folder = tmp / "certs"
    opcua = {"listen": f"opc.tcp://127.0.0.1:{free_port()}", "users_file": str(users), "cert_dir": str(folder / "pki")}
    config = _config(tmp, ports, opcua=opcua, trigger={})
    with read_only_folder(folder):
        result = run_cli("check", "--config", str(config))
        assert result.returncode == 1, result.stdout + result.stderr
        assert f"opcua.cert_dir: the server certificate cannot be made in {folder}/pki: " in result.stderr
        daemon = RunningDaemon(config, f"tcp://127.0.0.1:{ports[0]}")
        try:
            daemon.collect("detections", 1)  # run serves all the same, without OPC UA
        finally:
            daemon.close()


def _folder(at: Path, sizes: dict[str, tuple[int, int]]) -> Path:
    """A folder of grey images, each named with its width and height."""
    at.mkdir()
    for name, (width, height) in sizes.items():
        cv2.imwrite(str(at / name), np.full((height, width, 3), 90, np.uint8))
    return at


def test_an_image_folder_whose_first_image_the_roi_misses_is_checked_with_one_it_fits(tmp: Path, ports: list[int]) -> None:
    """Run skips an image ``inspect.roi`` does not fit in (bad_frame_size) and serves the folder's others;
    check stopped with exit 78 on the folder's first image. Now it says how many run would skip, naming
    the first, and checks the first that fits; a folder of none that fits still stops it."""
    inspect = {"ng_classes": ["crack"], "roi": [10, 10, 120, 90]}
    folder = _folder(tmp / "parts", {"a.png": (64, 48), "b.png": (128, 96), "c.png": (64, 48)})
    source = {"type": "images", "path": str(folder), "pace": False}
    config = _config(tmp, ports, model={"path": str(TASKS / "cls.onnx")}, inspect=inspect, source=source)
    result = run_cli("check", "--config", str(config))
    assert result.returncode == 0, result.stdout + result.stderr
    lines = [line.strip() for line in result.stdout.splitlines()]
    delivers = next(line for line in lines if line.startswith("delivers "))  # no rate to measure: it said 0.0 fps
    assert delivers.startswith("delivers 64x48 unpaced (pace = false: each image as the model takes it), "), delivers
    assert (
        f"run would skip 2 of the 3 images at {folder} for their size (bad_frame_size), the first a.png: "
        "inspect.roi [10, 10, 120, 90] does not fit in a 64x48 frame: set it inside the frame" in lines
    )
    assert any(line.startswith("first image that fits (b.png): classes ") for line in lines), result.stdout
    assert lines[-1] == "ok"
    (folder / "b.png").unlink()
    result = run_cli("check", "--config", str(config))
    assert result.returncode == 78, result.stdout + result.stderr
    assert "inspect.roi [10, 10, 120, 90] does not fit in a 64x48 frame" in result.stderr
    assert "run would skip" not in result.stdout


def test_an_unpaced_video_is_said_to_be_unpaced_not_measured_at_no_rate(tmp: Path, ports: list[int]) -> None:
    """A file read with realtime = false has no rate: check said it delivers "at 0.0 fps (measured)"."""
    write_video(tmp / "clip.avi", [(0, 0, 200)] * 3)
    source = {"type": "file", "path": "clip.avi", "loop": False, "realtime": False}
    config = _config(tmp, ports, source=source)
    out = io.StringIO()
    assert run_check(config, load_config(config), None, out, bind=False) == 0
    lines = [line.strip() for line in out.getvalue().splitlines()]
    delivers = next(line for line in lines if line.startswith("delivers "))
    assert delivers.startswith("delivers 128x96 unpaced (realtime = false: each frame as the model takes it), "), delivers


def test_an_image_folder_whose_first_image_passes_the_mask_budget_is_checked_with_one_within_it(
    tmp: Path, ports: list[int]
) -> None:
    """600 masks of a 1920x1080 image need 1.2 GiB: run skips that image (bad_frame_size) and serves
    the others; check stopped with exit 78 on it, the folder's first. A folder of such images alone still does."""
    folder = _folder(tmp / "parts", {"a.png": (1920, 1080), "b.png": (320, 180)})
    source = {"type": "images", "path": str(folder)}
    config = _config(tmp, ports, model={"path": str(TASKS / "seg.onnx"), "max_masks": 600}, source=source)
    result = run_cli("check", "--config", str(config))
    assert result.returncode == 0, result.stdout + result.stderr
    lines = [line.strip() for line in result.stdout.splitlines()]
    assert (
        f"run would skip 1 of the 2 images at {folder} for their size (bad_frame_size), the first a.png: "
        "model.max_masks = 600 would need 1.2 GiB of mask buffers for 1920x1080 frames" in result.stdout
    )
    assert any(line.startswith("first image that fits (b.png): ") for line in lines), result.stdout
    (folder / "b.png").unlink()
    result = run_cli("check", "--config", str(config))
    assert result.returncode == 78, result.stdout + result.stderr
    assert "model.max_masks = 600 would need 1.2 GiB of mask buffers for 1920x1080 frames" in result.stderr


def test_an_image_the_header_says_fits_but_decodes_turned_is_skipped_for_the_next(tmp: Path, ports: list[int]) -> None:
    """OpenCV turns a PNG by its EXIF orientation: stored 120x60, it decodes 60x120, which the region does
    not fit; check chose it by its header's size and exited 78 on it, though run serves b.png."""
    folder = _folder(tmp / "parts", {"b.png": (120, 60), "c.png": (64, 48)})
    (folder / "a.png").write_bytes(_turned_png(120, 60))
    source = {"type": "images", "path": str(folder)}
    inspect = {"ng_classes": ["crack"], "roi": [0, 0, 100, 50]}
    config = _config(tmp, ports, model={"path": str(TASKS / "cls.onnx")}, inspect=inspect, source=source)
    result = run_cli("check", "--config", str(config))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"run would skip 2 of the 3 images at {folder} for their size (bad_frame_size), the first a.png" in result.stdout
    assert any(line.strip().startswith("first image that fits (b.png): ") for line in result.stdout.splitlines())


def _turned_png(width: int, height: int) -> bytes:
    """A grey PNG of ``width`` x ``height`` whose eXIf chunk says orientation 6: decoded turned a quarter."""
    png = cv2.imencode(".png", np.full((height, width, 3), 90, np.uint8))[1].tobytes()
    tiff = b"MM\x00\x2a\x00\x00\x00\x08" + struct.pack(">H", 1) + struct.pack(">HHIHH", 0x0112, 3, 1, 6, 0) + bytes(4)
    chunk = struct.pack(">I", len(tiff)) + b"eXIf" + tiff + struct.pack(">I", zlib.crc32(b"eXIf" + tiff))
    at = png.index(b"IDAT") - 4
    return png[:at] + chunk + png[at:]


def test_a_camera_whose_frames_the_roi_misses_still_fails_the_check(tmp: Path, ports: list[int]) -> None:
    # Every frame of a camera is its size: run would reject them all, so check stops as it did.
    source = {"type": "synthetic", "width": 64, "height": 48, "fps": 20.0}
    inspect = {"ng_classes": ["crack"], "roi": [10, 10, 120, 90]}
    config = _config(tmp, ports, model={"path": str(TASKS / "cls.onnx")}, inspect=inspect, source=source)
    result = run_cli("check", "--config", str(config))
    assert result.returncode == 78, result.stdout + result.stderr
    assert "inspect.roi [10, 10, 120, 90] does not fit in a 64x48 frame" in result.stderr


def test_check_warns_when_a_segmentation_models_outlines_can_pass_what_subscribers_take(tmp: Path, ports: list[int]) -> None:
    """100 outlines of 5000 points, 17 bytes each, are 8.5 MB, and edged's subscribers refuse a
    message over 1 MiB: check said ok without a word. The defaults (20 of 2000) are 0.7 MB."""
    raised = {"path": str(TASKS / "seg.onnx"), "max_masks": 100, "max_outline_points": 5000}
    result = run_cli("check", "--config", str(_config(tmp, ports, model=raised)))
    assert result.returncode == 0, result.stdout + result.stderr
    assert (
        "warning: a frame's detections message can reach 8.5 MB, more than the 1 MiB edged's subscribers take: "
        "100 outlines (model.max_masks = 100, model.max_det = 100) of up to 5000 points (model.max_outline_points), "
        "17 bytes a point; lower model.max_outline_points to 616 or model.max_masks to 12" in result.stdout
    )
    result = run_cli("check", "--config", str(_config(tmp, ports, model={"path": str(TASKS / "seg.onnx")})))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "warning" not in result.stdout


@pytest.mark.skipif(os.geteuid() != 0, reason="asking as another user needs root, as sudo edged check is")
def test_an_ipc_socket_the_services_user_cannot_make_fails_the_check_as_root(tmp: Path, ports: list[int]) -> None:
    """Root binds the socket anywhere; the service, as its user, cannot make it in a folder only root
    may write, and run then fails to bind."""
    from edged.errors import BindError
    from edged.unit import Unit

    shared = Path(tempfile.mkdtemp(prefix="edged-ipc-", dir="/tmp"))
    try:
        shared.chmod(0o755)  # root's, as `sudo mkdir` leaves it
        publish = {"endpoints": [f"ipc://{shared}/detections.sock"]}
        config = _config(tmp, ports, publish=publish, journal={"enabled": False})
        shown = "LoadState=loaded\nUser=nobody\nProtectSystem=no\n"
        with pytest.raises(BindError) as refused:
            run_check(config, load_config(config), Unit.parse("edged.service", shown), io.StringIO())
        assert str(refused.value) == (
            f"publish.endpoints: the service cannot make its socket {shared}/detections.sock: edged.service runs as "
            f"nobody, who may not write in {shared}: chown nobody {shared}, or give another"
        )
        os.chown(shared, 65534, -1)
        assert run_check(config, load_config(config), Unit.parse("edged.service", shown), io.StringIO()) == 0
    finally:
        shutil.rmtree(shared)


NOT_HERE = "192.0.2.1"  # TEST-NET-1 (RFC 5737): an address no board has


def _refusal(command: str, config: Path, *options: str) -> tuple[int, str]:
    """``edged COMMAND`` on ``config``: its exit code and the last problem it names, as check says it
    (``edged: check failed: ...``) or as run logs it (``ERROR edged: ...``)."""
    result = run_cli(command, *options, "--config", str(config))
    said = [
        line.split("edged: check failed: ")[-1].split(" ERROR edged: ")[-1]
        for line in result.stderr.splitlines()
        if line.startswith("edged: check failed: ") or " ERROR edged: " in line
    ]
    return result.returncode, said[-1] if said else result.stderr


@pytest.mark.parametrize(
    ("sections", "code", "said"),
    [
        pytest.param(
            lambda port: {"reject": {"chip": "gpiochip99", "line": 3, "delay_ms": 100}, "inspect": {"ng_classes": ["red"]}},
            78,
            "reject.chip 'gpiochip99' (camera cam0): /dev/gpiochip99: No such file or directory",
            id="reject-chip-missing",
        ),
        pytest.param(
            lambda port: {"publish": {"endpoints": [f"tcp://{NOT_HERE}:{port}"], "insecure": True}},
            1,
            f"publish.endpoints: cannot bind tcp://{NOT_HERE}:{{port}}: Cannot assign requested address",
            id="publish-address-not-here",
        ),
        pytest.param(
            lambda port: {"trigger": {"mode": "request", "endpoint": f"tcp://{NOT_HERE}:{port}", "insecure": True}},
            1,
            f"trigger.endpoint: cannot bind tcp://{NOT_HERE}:{{port}}: Cannot assign requested address",
            id="trigger-address-not-here",
        ),
    ],
)
def test_what_stops_run_at_start_fails_a_check_beside_the_service_too(
    tmp: Path, ports: list[int], sections: Callable[[int], dict], code: int, said: str
) -> None:
    """``check --no-bind``, run beside the service after an edit, said ok where run then refused to start:
    it left the reject lines and every address untried. It finds the line as run does (without taking
    it), and binds each address, passing over only one in use (the service's own, perhaps)."""
    port = free_port()
    config = _config(tmp, ports, **{"trigger": {}, **sections(port)})
    refused = _refusal("run", config)
    assert refused[0] == code and refused[1].startswith(said.format(port=port)), refused
    assert _refusal("check", config, "--no-bind") == refused


@pytest.mark.parametrize(
    ("source", "waited_s"),
    [
        ({"type": "images", "path": "."}, 30.0),
        ({"type": "gstreamer", "pipeline": "videotestsrc"}, 30.0),  # open_timeout_s 20
        ({"type": "gstreamer", "pipeline": "videotestsrc", "open_timeout_s": 300}, 305.0),
        ({"type": "rtsp", "url": "rtsp://camera/stream", "open_timeout_s": 90}, 95.0),
    ],
)
def test_check_waits_for_a_first_frame_as_long_as_run_lets_the_camera_open(source: dict, waited_s: float) -> None:
    """A camera given open_timeout_s above 30 s failed the check, "none in 30 s", where run waited and
    served it (or failed later, for its own reason): check waits as long, and a little more."""
    from edged.check import first_frame_timeout_s
    from edged.settings.sources import KINDS

    assert first_frame_timeout_s(KINDS[source["type"]].model_validate(source)) == waited_s


HOLD = (
    "import fcntl, os, sys; fcntl.flock(os.open(sys.argv[1], os.O_RDWR | os.O_CREAT), fcntl.LOCK_EX); "
    "print(flush=True); sys.stdin.read()"
)


@contextlib.contextmanager
def _holder(lock: Path, *args: str, cwd: Path, prefix: tuple[str, ...] = ()) -> Iterator[int]:
    """A process holding ``lock`` whose command line ends ``run ARGS``, as an `edged run` holds its journal."""
    proc = subprocess.Popen([*prefix, sys.executable, "-c", HOLD, str(lock), "run", *args], cwd=cwd, stdin=PIPE, stdout=PIPE)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == b"\n", "the lock was not taken"
        yield proc.pid
    finally:
        proc.kill()
        proc.communicate()


@pytest.mark.parametrize("spelling", ["--conf {}", "-c{}", "--confi={}", "-c edged.toml", "--config=edged.toml"])
def test_no_bind_knows_the_services_journal_however_its_config_was_given(tmp_path: Path, spelling: str) -> None:
    """`edged run --conf X` (argparse takes any abbreviation) and `-cX` were read as running the default
    configuration, and check --no-bind beside that service said another edged held its journal (78)."""
    config, journal = tmp_path / "edged.toml", tmp_path / "journal.sqlite"
    config.write_text("")
    with _holder(Path(f"{journal}.lock"), *spelling.format(config).split(), cwd=tmp_path):
        assert held_by_another(journal, config) is None
        other = tmp_path / "other.toml"
        other.write_text("")
        assert "is held by another edged (process" in (held_by_another(journal, other) or "")


def test_no_bind_knows_the_services_journal_where_its_config_is_mounted_elsewhere(tmp_path: Path) -> None:
    """A service that sees its configuration at another path (BindPaths=, a container) was said to be
    another edged: the path in its command line was looked up in check's mounts, not in its own."""
    config, journal, seen = tmp_path / "edged.toml", tmp_path / "journal.sqlite", tmp_path / "seen"
    config.write_text("")
    seen.mkdir()
    mount = f'mount --bind "{tmp_path}" "{seen}" && exec "$@"'
    if os.geteuid() != 0 or subprocess.run(["unshare", "-m", "true"]).returncode:
        pytest.skip("this process may not make a mount namespace")
    prefix = ("unshare", "-m", "--propagation", "private", "sh", "-c", mount, "sh")
    with _holder(Path(f"{journal}.lock"), "--config", str(seen / "edged.toml"), cwd=tmp_path, prefix=prefix):
        assert held_by_another(journal, config) is None
