"""The bundled demo: the trained defect model on the synthetic source, end to end against truth."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import urllib.request
from contextlib import suppress
from pathlib import Path

import cv2
import numpy as np
import pytest
import zmq
from daemon import RunningDaemon, free_port, run_cli, write_config
from waiting import wait_for

from edged.config import load_config
from edged.messages import DetectionsMessage
from edged.sources.scenes import CLASS_NAMES, SceneGenerator
from edged.tools.metrics import box_iou

pytestmark = pytest.mark.integration

ROOT = Path(__file__).parent.parent
MODEL = ROOT / "models" / "demo.onnx"
SEGMENT_CONFIG = ROOT / "config" / "segment-demo.toml"
CELL = 16  # frame pixels per prototype cell of the segmentation demo: 1280 / 320 x stride 4
SEED = 0  # held out from the demo model's training


def _matches_truth(msg: DetectionsMessage, generator: SceneGenerator) -> bool:
    """Every defect found with the right class at IoU >= 0.5, and nothing else reported."""
    truth = generator.render(msg.frame_id)
    boxes = np.array([d.box for d in msg.detections], np.float64).reshape(-1, 4)
    labels = [d.label for d in msg.detections]
    if len(boxes) != len(truth.boxes):
        return False
    if not len(boxes):
        return True
    ious = box_iou(truth.boxes.astype(np.float64), boxes)
    for i, class_id in enumerate(truth.class_ids):
        same_class = [j for j, label in enumerate(labels) if label == CLASS_NAMES[class_id]]
        if not same_class or ious[i, same_class].max() < 0.5:
            return False
    return True


def _first_frames(config: Path, endpoint: str, count: int = 20) -> list[DetectionsMessage]:
    """The first ``count`` frames' messages of the daemon run on ``config``, publishing on ``endpoint``."""
    d = RunningDaemon(config, endpoint)
    try:
        return [m for m in d.collect("detections", count, timeout=60) if isinstance(m, DetectionsMessage)]
    finally:
        d.close()


def test_demo_config_is_valid_and_checks() -> None:
    settings = load_config(ROOT / "config" / "demo.toml")
    assert settings.model.path == MODEL.resolve()
    result = run_cli("check", "--config", str(ROOT / "config" / "demo.toml"))
    assert result.returncode == 0, result.stderr
    assert "3 classes: scratch, spot, crack" in result.stdout


def test_the_demo_configurations_run_side_by_side() -> None:
    """Each demo has its own journal, stream and live view: the two recording ones shared the
    journal beside them, so the second started was refused while the first ran."""
    demos = [load_config(path) for path in sorted((ROOT / "config").glob("*demo.toml"))]
    assert len(demos) == 3
    recording = [s.journal.file for s in demos if s.inspect is not None]
    assert len(recording) == 2 and len(set(recording)) == 2, recording
    endpoints = [e for s in demos for e in s.publish.endpoints]
    assert len(set(endpoints)) == len(endpoints), endpoints
    listens = [s.http.listen for s in demos]
    assert len(set(listens)) == len(listens), listens


def test_demo_model_finds_the_generated_defects_on_most_frames(tmp_path: Path) -> None:
    shutil.copy(MODEL, tmp_path / "demo.onnx")
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    config = write_config(
        tmp_path / "edged.toml",
        {
            "source": {"type": "synthetic", "width": 1280, "height": 720, "fps": 8.0, "seed": SEED},
            "model": {"path": "demo.onnx"},
            "publish": {"endpoints": [endpoint]},
            "thermal": {"enabled": False},
        },
    )
    messages = _first_frames(config, endpoint)
    generator = SceneGenerator(1280, 720, seed=SEED)
    matched = sum(_matches_truth(m, generator) for m in messages)
    assert matched >= 0.7 * len(messages), f"{matched} of {len(messages)} frames match the ground truth"
    assert any(m.detections for m in messages)


def _demo_tree(tmp_path: Path, port: int, http_port: int | None = None) -> Path:
    """The repository's demo script and config on ``port`` (and its live view on ``http_port``, a
    free one by default), beside the models, in a tree of its own.

    ``scripts/setup`` installs Debian packages and the virtualenv, which are in place here: its
    stand-in does nothing, and ``.venv/bin/edged`` is this interpreter running edged.
    """
    root = tmp_path / "repo"
    (root / "scripts").mkdir(parents=True)
    (root / "config").mkdir()
    (root / ".venv" / "bin").mkdir(parents=True)
    (root / "models").symlink_to(ROOT / "models")
    ports = {"127.0.0.1:5556": f"127.0.0.1:{port}", "127.0.0.1:8080": f"127.0.0.1:{http_port or free_port()}"}
    config = (ROOT / "config" / "demo.toml").read_text()
    script = (ROOT / "scripts" / "demo").read_text()
    for default, used in ports.items():
        assert default in config and default in script
        config, script = config.replace(default, used), script.replace(default, used)
    (root / "config" / "demo.toml").write_text(config)
    executables = {
        root / "scripts" / "demo": script,
        root / "scripts" / "setup": "#!/bin/sh\n",
        root / ".venv" / "bin" / "edged": f'#!/bin/sh\nexec {sys.executable} -m edged "$@"\n',
    }
    for path, text in executables.items():
        path.write_text(text)
        path.chmod(0o755)
    return root


def _children(pid: int) -> list[int]:
    """The processes ``pid`` started, but for the demo's own `sleep` between its looks at them, and a
    copy of the demo forked for one that has yet to become it (its command line still the demo's)."""
    try:
        own = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:  # the demo has ended: no copy of it left to become a child
        own = None
    children = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
                command = (entry / "cmdline").read_bytes()
            except OSError:  # gone meanwhile
                continue
            name, rest = stat.split(" (", 1)[1].rsplit(")", 1)
            if int(rest.split()[1]) == pid and name != "sleep" and command != own:
                children.append(int(entry.name))
    return children


def _command(pid: int) -> str:
    """The process's command line, "" once it is gone."""
    try:
        return (Path("/proc") / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _state(pid: int) -> str:
    """The process's state in /proc: R running, S sleeping, T stopped, Z a zombie...; "" once it is gone."""
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return ""


def _alive(pid: int) -> bool:
    """Running, as opposed to gone or a zombie waiting to be reaped."""
    return _state(pid) not in ("", "Z")


# Runs argv[1:] in a process group of its own (``process_group=`` is Python 3.11's).
_JOB = "import os, sys; os.setpgid(0, 0); os.execv(sys.argv[1], sys.argv[1:])"


class Demo:
    """``scripts/demo`` as a user runs it, its output in a file (its stderr in another with ``apart``)."""

    def __init__(self, root: Path, tmp_path: Path, *, apart: bool = False) -> None:
        self.output = tmp_path / "demo.out"
        self.errors = tmp_path / "demo.err"
        with self.output.open("w") as out, self.errors.open("w") as err:
            stderr = err if apart else subprocess.STDOUT
            # As a shell starts a job: in a process group of its own, the one Ctrl-C and Ctrl-Z signal, in
            # the shell's session. A group with no parent in its session (alone in a session of its own)
            # is orphaned, and the kernel discards a Ctrl-Z sent to it.
            self.proc = subprocess.Popen([sys.executable, "-c", _JOB, root / "scripts" / "demo"], stdout=out, stderr=stderr)

    def text(self) -> str:
        return self.output.read_text()

    def exit_code(self, timeout_s: float) -> int:
        """The demo's exit status; past ``timeout_s``, an AssertionError with what it printed and what
        each process it started is doing (its state and command line)."""
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            doing = {pid: (_state(pid), _command(pid)) for pid in _children(self.proc.pid)}
            raise AssertionError(f"the demo runs on after {timeout_s} s; its processes {doing}:\n{self.text()}") from None

    def close(self) -> None:
        for pid in _children(self.proc.pid):
            os.kill(pid, signal.SIGKILL)
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def test_the_demo_says_on_stdout_where_its_live_view_is_once_the_daemon_listens(tmp_path: Path) -> None:
    http_port = free_port()
    demo = Demo(_demo_tree(tmp_path, free_port(), http_port), tmp_path, apart=True)
    url = f"http://127.0.0.1:{http_port}/"
    try:
        assert wait_for(lambda: url in demo.text(), timeout_s=90), (demo.text(), demo.errors.read_text())
        assert f"demo: the live view is at {url} (open it in a browser" in demo.text()
        with urllib.request.urlopen(url, timeout=30) as answer:  # said once it listens
            assert answer.status == 200
        assert wait_for(lambda: "detection(s)" in demo.text(), timeout_s=90), demo.text()
        assert demo.text().index(url) < demo.text().index("detection(s)")  # before the detections scroll
        assert "demo: the live view" not in demo.errors.read_text()
    finally:
        demo.close()


def test_a_demo_whose_live_view_port_is_taken_does_not_point_at_it(tmp_path: Path) -> None:
    # The page at that address is the other program's: the demo said it was the live view.
    http_port = free_port()
    other = socket.create_server(("127.0.0.1", http_port))
    try:
        demo = Demo(_demo_tree(tmp_path, free_port(), http_port), tmp_path, apart=True)
        try:
            assert wait_for(lambda: "detection(s)" in demo.text(), timeout_s=90), (demo.text(), demo.errors.read_text())
        finally:
            demo.close()
    finally:
        other.close()
    assert f"127.0.0.1:{http_port} is another program's, so the live view is not there" in demo.errors.read_text()
    assert "demo: the live view is at" not in demo.text()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_killing_the_demo_leaves_no_daemon_behind(tmp_path: Path, sig: signal.Signals) -> None:
    demo = Demo(_demo_tree(tmp_path, free_port()), tmp_path)
    try:
        assert wait_for(lambda: "detection(s)" in demo.text(), timeout_s=90), demo.text()
        children = _children(demo.proc.pid)
        commands = [Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") for pid in children]
        assert sorted(c[c.index(b"edged") + 1] for c in commands) == [b"run", b"subscribe"], commands
        demo.proc.send_signal(sig)
        assert demo.proc.wait(20) == (143 if sig == signal.SIGTERM else -signal.SIGKILL)
        assert wait_for(lambda: not any(_alive(pid) for pid in children), timeout_s=20), demo.text()
    finally:
        demo.close()


def _running_in(root: Path) -> list[int]:
    """Every process working in ``root``: the demo's, whatever became of their parents."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with suppress(OSError):
                if Path(os.readlink(entry / "cwd")).is_relative_to(root) and _alive(int(entry.name)):
                    found.append(int(entry.name))
    return found


def _daemon(demo: Demo) -> int | None:
    """The demo's ``edged run`` once it is in Python (starting: loading its model, opening its camera)."""
    for pid in _children(demo.proc.pid):
        with suppress(OSError):
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if argv[0] == os.fsencode(sys.executable) and b"run" in argv:
                return pid
    return None


@pytest.mark.parametrize("when", ["running", "starting"])
def test_ctrl_c_stops_the_demo_once_and_leaves_nothing_running(tmp_path: Path, when: str) -> None:
    """Ctrl-C reached the daemon itself (in the terminal's process group) and then the demo's exit
    sent it SIGTERM: it said it was stopping twice, once for each signal."""
    root = _demo_tree(tmp_path, free_port())
    demo = Demo(root, tmp_path)
    try:
        if when == "running":
            assert wait_for(lambda: "detection(s)" in demo.text(), timeout_s=90), demo.text()
        else:
            assert wait_for(lambda: _daemon(demo) is not None, timeout_s=30), demo.text()
        os.killpg(demo.proc.pid, signal.SIGINT)  # what the terminal does on Ctrl-C
        assert demo.proc.wait(30) == 130, demo.text()
        assert wait_for(lambda: not _running_in(root), timeout_s=20), (_running_in(root), demo.text())
    finally:
        demo.close()
    stops = [line for line in demo.text().splitlines() if ": stopping" in line]
    if when == "running":
        assert len(stops) == 1, demo.text()
    else:  # a daemon signalled before it set its handlers ends without a word
        assert len(stops) <= 1, demo.text()


@pytest.mark.parametrize("when", ["running", "starting"])
def test_ctrl_z_suspends_the_whole_demo_and_fg_resumes_it(tmp_path: Path, when: str) -> None:
    """Ctrl-Z stopped the demo's script alone: its daemon and subscriber, in sessions of their own,
    went on printing under the shell's prompt, and ``fg`` resumed the script alone. Starting, the
    script waits for the live view between two polls, in the terminal's process group as well."""
    root = _demo_tree(tmp_path, free_port())
    demo = Demo(root, tmp_path)
    try:
        if when == "running":
            assert wait_for(lambda: "detection(s)" in demo.text(), timeout_s=90), demo.text()
            children = _children(demo.proc.pid)
            assert len(children) == 2, children
        else:
            assert wait_for(lambda: _daemon(demo) is not None, timeout_s=30), demo.text()
            daemon = _daemon(demo)
            assert daemon is not None, demo.text()
            children = [daemon]  # the subscriber starts once the live view listens
        os.killpg(demo.proc.pid, signal.SIGTSTP)  # what the terminal does on Ctrl-Z
        assert wait_for(lambda: all(_state(pid) == "T" for pid in children), timeout_s=20), [_state(p) for p in children]
        assert wait_for(lambda: _state(demo.proc.pid) == "T", timeout_s=20), _state(demo.proc.pid)
        printed = demo.text().count("detection(s)")
        os.killpg(demo.proc.pid, signal.SIGCONT)  # what the shell does on fg
        running = [demo.proc.pid, *children]
        assert wait_for(lambda: all(_state(pid) not in ("T", "Z", "") for pid in running), timeout_s=20), [
            _state(pid) for pid in running
        ]
        assert wait_for(lambda: demo.text().count("detection(s)") > printed, timeout_s=30), demo.text()
        assert demo.proc.poll() is None, demo.text()  # a resume is no child's exit
        os.killpg(demo.proc.pid, signal.SIGINT)
        assert demo.proc.wait(30) == 130, demo.text()
        assert wait_for(lambda: not _running_in(root), timeout_s=20), (_running_in(root), demo.text())
    finally:
        demo.close()
    stops = [line for line in demo.text().splitlines() if ": stopping" in line]
    assert len(stops) == 1, demo.text()


def test_a_demo_whose_port_is_taken_shows_the_bind_error_and_fails(tmp_path: Path) -> None:
    port = free_port()
    context = zmq.Context()
    orphan = context.socket(zmq.PUB)  # what an earlier demo's daemon left running would hold
    orphan.bind(f"tcp://127.0.0.1:{port}")
    try:
        demo = Demo(_demo_tree(tmp_path, port), tmp_path)
        try:
            assert demo.exit_code(90) == 1, demo.text()
            children = _children(demo.proc.pid)
        finally:
            demo.close()
    finally:
        orphan.close(linger=0)
        context.term()
    out = demo.text()
    assert f"cannot bind tcp://127.0.0.1:{port}: Address already in use" in out, out
    assert "another program holds it" in out and "demo: edged run stopped with exit status 1" in out
    assert not children


def test_anomaly_demo_config_is_valid_and_its_first_frame_is_scored() -> None:
    config = ROOT / "config" / "anomaly-demo.toml"
    settings = load_config(config)
    assert settings.model.path == (ROOT / "tests" / "data" / "anomaly" / "padim.onnx").resolve()
    result = run_cli("check", "--config", str(config), "--no-bind")
    assert result.returncode == 0, result.stderr
    assert "first frame: anomaly score" in result.stdout


def test_segment_demo_config_is_valid_and_its_first_frame_has_sized_defects() -> None:
    settings = load_config(SEGMENT_CONFIG)
    assert settings.model.path == (ROOT / "models" / "demo-seg.onnx").resolve()
    result = run_cli("check", "--config", str(SEGMENT_CONFIG), "--no-bind")
    assert result.returncode == 0, result.stderr
    assert "segment head, 3 classes: scratch, spot, crack" in result.stdout


def _on_defect(polygon: list[tuple[float, float]], truth: np.ndarray) -> bool:
    """Whether ``polygon`` outlines part of the painted defect ``truth``, and little else: nine tenths
    of its pixels within one prototype cell (16 frame pixels) of the paint, and some of the paint
    inside it. Not a mask IoU: on the prototypes' grid, a quarter of the input's size, a scratch 3
    pixels wide is drawn a cell wide, and a thin defect's mask comes out in pieces."""
    drawn = np.zeros(truth.shape, np.uint8)
    cv2.fillPoly(drawn, [np.round(np.asarray(polygon)).astype(np.int32)], 1)
    near = cv2.dilate(truth.astype(np.uint8), np.ones((2 * CELL + 1, 2 * CELL + 1), np.uint8))
    on = np.logical_and(drawn, near).sum() / max(int(drawn.sum()), 1)
    return bool(on >= 0.9 and np.logical_and(drawn, truth).any())


def test_segment_demo_outlines_and_sizes_the_generated_defects(tmp_path: Path) -> None:
    """The segmentation demo as configured (scale and dust limit included), on held-out scenes:
    every message says its task, nearly every defect an outline on a painted one, each its size in
    mm, and a spot under 1 mm2 alone is within limits."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    config = SEGMENT_CONFIG.read_text().replace("tcp://127.0.0.1:5558", endpoint)
    config = config.replace('listen = "127.0.0.1:8082"', f'listen = "127.0.0.1:{free_port()}"')
    config = config.replace("fps = 10.0", f"fps = 8.0\nseed = {SEED}").replace("../models/", f"{ROOT}/models/")
    path = tmp_path / "segment.toml"
    path.write_text(config)
    # Spots under 1 mm2 are rare in these scenes (frames 1 and 37 of the first 80); the camera runs
    # while the model loads, so a start slower than one frame passes frame 1 by.
    messages = _first_frames(path, endpoint, 40)
    generator = SceneGenerator(1280, 720, seed=SEED)
    outlined = found = tolerated = 0
    for msg in messages:
        assert msg.task == "segment"
        truth = generator.render(msg.frame_id, masks=True)
        assert truth.masks is not None
        for det in msg.detections:
            assert det.polygon and det.area_px and det.length_px and det.area_mm2 is not None
            assert det.area_mm2 == pytest.approx(det.area_px * 0.05**2, abs=0.001)  # each rounded on its own
            assert det.length_mm == pytest.approx(det.length_px * 0.05, abs=0.006)
            assert (det.note == "within limits") == (det.label == "spot" and det.area_mm2 <= 1.0)
            found += 1
            tolerated += det.note is not None
            outlined += any(_on_defect(det.polygon, m) for m in truth.masks)
    assert found and outlined >= 0.8 * found, f"{outlined} of {found} outlines lie on a painted defect"
    assert tolerated, "no spot under 1 mm2 in these frames: the dust limit went untried"
