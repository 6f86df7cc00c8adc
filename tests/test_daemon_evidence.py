"""Evidence end to end: the real daemon saves frames as it inspects them, and keeps inspecting when it cannot."""

from __future__ import annotations

import contextlib
import json
import os
import re
import resource
import shutil
import signal
import time
from collections.abc import Callable
from pathlib import Path

import cv2
import numpy as np
import pytest
from daemon import RunningDaemon, free_port, refused_by_check_and_run, write_config
from filesystems import read_only_folder, tmpfs
from onnx_models import LABELS, colour_probe

from edged.decode import Detections
from edged.evidence import DATASET_FILES, EvidenceFrame, EvidenceStore, class_folder
from edged.messages import DetectionsMessage, StatusMessage, parse_message
from edged.tools.evaluate import folder_samples

pytestmark = pytest.mark.integration

TASKS = Path(__file__).parent / "data" / "tasks"
IMAGES = 8  # frame i shows image i % IMAGES: even ones reddish noise (a "red" detection), odd ones black (none)
PROBE_BOX = (48.0, 20.0, 80.0, 44.0)  # the probe's box in a 128x96 frame


def noise(seed: int) -> np.ndarray:
    """A reddish noise image: the probe sees red, and its JPEG is tens of KB (a few fill a small disk)."""
    rng = np.random.default_rng(seed)
    image = rng.integers(0, 60, (96, 128, 3), np.uint8)
    image[..., 2] = rng.integers(150, 256, (96, 128), np.uint8)
    return image


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    colour_probe(tmp_path / "probe.onnx")
    (tmp_path / "imgs").mkdir()
    for i in range(IMAGES):
        image = noise(i) if i % 2 == 0 else np.zeros((96, 128, 3), np.uint8)
        cv2.imwrite(str(tmp_path / "imgs" / f"{i:03d}.png"), image)
    return tmp_path


def configure(
    workdir: Path,
    evidence: dict[str, object] | None,
    *,
    images: str = "imgs",
    publish: dict[str, object] | None = None,
    endpoint: str | None = None,
    model: str = "probe.onnx",
) -> tuple[Path, str]:
    """Write the daemon's config (``evidence`` None: no [evidence] section); its path and endpoint."""
    endpoint = endpoint or f"tcp://127.0.0.1:{free_port()}"
    doc: dict[str, dict[str, object]] = {
        "source": {"type": "images", "path": images, "fps": 20.0},
        "model": {"path": model},
        "publish": {"endpoints": [endpoint], "status_interval_s": 0.3, **(publish or {})},
        "thermal": {"enabled": False},
    }
    if evidence is not None:
        doc["evidence"] = {"dir": "evidence", **evidence}
    return write_config(workdir / "edged.toml", doc), endpoint


def start(
    workdir: Path,
    evidence: dict[str, object],
    *,
    images: str = "imgs",
    publish: dict[str, object] | None = None,
) -> RunningDaemon:
    return RunningDaemon(*configure(workdir, evidence, images=images, publish=publish))


def sets(folder: Path) -> list[Path]:
    """The saved images, oldest first."""
    return sorted(folder.rglob("images/*.jpg"), key=lambda p: p.name)


def disk_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def assert_no_half_sets(folder: Path) -> None:
    """No temp file, and every label and message beside an image of its own (beside the dataset's files)."""
    images = {p.stem for p in folder.rglob("*.jpg")}  # images/ and a classifier's images/CLASS/
    for path in folder.rglob("*"):
        if path.is_file() and path.name not in DATASET_FILES:
            assert not path.name.endswith(".tmp"), path
            assert path.stem in images, path


def evidence_of(status: StatusMessage) -> tuple[int, int, int, int]:
    e = status.evidence
    return (e.saved, e.dropped, e.errors, e.rate_limited) if e else (-1, -1, -1, -1)


def test_frames_with_detections_are_saved_as_images_labels_and_messages(workdir: Path) -> None:
    d = start(workdir, {"save": "ng", "max_per_minute": 0})
    try:
        status = d.wait_status(lambda s: evidence_of(s)[0] >= 6)
        assert evidence_of(status)[2] == 0
        stopping = time.monotonic()
        assert d.stop() == 0
        assert time.monotonic() - stopping < 2.0
    finally:
        d.close()
    saved = sets(workdir / "evidence")
    assert len(saved) >= 6
    for image_path in saved:
        image = cv2.imread(str(image_path))
        assert image is not None and image.shape == (96, 128, 3)
        message = parse_message((image_path.parent.parent / "messages" / f"{image_path.stem}.json").read_bytes())
        assert isinstance(message, DetectionsMessage)
        assert message.frame_id % 2 == 0, "a black frame has no detection: never saved under save = ng"
        # The frame as captured, not annotated: exactly its source image through JPEG at jpeg_quality.
        _, jpeg = cv2.imencode(".jpg", noise(message.frame_id % IMAGES), [cv2.IMWRITE_JPEG_QUALITY, 95])
        assert np.array_equal(image, cv2.imdecode(jpeg, cv2.IMREAD_COLOR))
        assert [(det.label, det.box) for det in message.detections] == [("red", PROBE_BOX)]
    samples = list(folder_samples(workdir / "evidence", 2)[1])  # `edged eval --data` reads the folder as it is
    assert len(samples) == len(saved)
    for sample in samples:
        assert sample.class_ids.tolist() == [0]
        np.testing.assert_allclose(sample.boxes, [PROBE_BOX], atol=1e-3)  # labels parse back to the same boxes
    assert_no_half_sets(workdir / "evidence")


def test_under_a_umask_of_000_nothing_edged_makes_is_anyones_to_write(workdir: Path) -> None:
    """Started by hand from a shell with umask 000, edged made its evidence (and journal, and each ipc
    socket until its chmod) writable by every user of the board."""
    path, endpoint = configure(workdir, {"save": "all", "max_per_minute": 0})
    d = RunningDaemon(path, endpoint, wrap=lambda argv: ["sh", "-c", 'umask 000 && exec "$@"', "edged", *argv])
    try:
        d.wait_status(lambda s: evidence_of(s)[0] >= 1)
    finally:
        d.close()
    made = [workdir / "evidence", *(workdir / "evidence").rglob("*")]
    assert len(made) > 5 and not [p for p in made if p.stat().st_mode & 0o002], [oct(p.stat().st_mode) for p in made]


def test_the_folder_is_a_dataset_whose_labels_hold_the_detections_outside_the_zones_too(workdir: Path) -> None:
    path, endpoint = configure(workdir, {"save": "all", "max_per_minute": 0})
    with path.open("a") as config:  # a zone on the right; the probe's box is left of it
        config.write('[inspect]\noutside_zones = "drop"\nzones = { right = [[0.8, 0], [1, 0], [1, 1], [0.8, 1]] }\n')
    d = RunningDaemon(path, endpoint)
    try:
        d.wait_status(lambda s: evidence_of(s)[0] >= IMAGES)
        assert d.stop() == 0
    finally:
        d.close()
    folder = workdir / "evidence" / "cam0"
    data = (folder / "data.yaml").read_text()
    assert [line for line in data.splitlines() if not line.startswith("#")] == [
        'train: "."',
        'val: "."',
        "nc: 2",
        "names:",
        *(f'  {i}: "{name}"' for i, name in enumerate(LABELS)),
    ]
    assert (folder / "classes.txt").read_text() == "".join(f"{name}\n" for name in LABELS)
    red = 0
    for image_path in sets(folder):
        message = parse_message((image_path.parent.parent / "messages" / f"{image_path.stem}.json").read_bytes())
        assert isinstance(message, DetectionsMessage) and message.detections == []  # outside the zone: not published
        label = (image_path.parent.parent / "labels" / f"{image_path.stem}.txt").read_text()
        if message.frame_id % 2 == 0:
            red += 1
            assert label == "0 0.500000 0.333333 0.250000 0.250000\n"  # PROBE_BOX in a 128x96 frame
        else:
            assert label == ""
    assert red >= IMAGES // 2


def test_an_unpaced_folder_names_each_saved_frame_s_image_file_in_its_message(workdir: Path) -> None:
    path, endpoint = configure(workdir, {"save": "all", "max_per_minute": 0})
    path.write_text(path.read_text().replace("fps = 20.0", "fps = 20.0\npace = false\nloop = false"))
    d = RunningDaemon(path, endpoint)
    try:
        assert d.proc.wait(30) == 0, d.log()  # every image once, then the source ends
    finally:
        d.close()
    saved = sets(workdir / "evidence")
    assert saved
    for image_path in saved:
        message = parse_message((image_path.parent.parent / "messages" / f"{image_path.stem}.json").read_bytes())
        assert isinstance(message, DetectionsMessage)
        assert message.source_file == f"{message.frame_id:03d}.png"  # frame i is the folder's image i


def test_save_all_keeps_empty_frames_too_with_a_message_only_where_one_was_published(workdir: Path) -> None:
    d = start(workdir, {"save": "all", "max_per_minute": 0}, publish={"publish_empty": False})
    try:
        d.wait_status(lambda s: evidence_of(s)[0] >= 8)
        assert d.stop() == 0
    finally:
        d.close()
    black = [p for p in sets(workdir / "evidence") if int(p.stem.rsplit("_", 1)[1]) % 2 == 1]
    assert black, "black frames are saved under save = all"
    for image_path in black:
        folder, stem = image_path.parent.parent, image_path.stem
        assert (folder / "labels" / f"{stem}.txt").read_text() == ""  # a negative example for training
        assert not (folder / "messages" / f"{stem}.json").exists()  # not published: no message


def prefill(folder: Path, count: int, *, t0_ns: int, age_days: float) -> list[str]:
    """``count`` sets saved as the daemon would, their files aged by ``age_days``; their stems, oldest first."""
    store = EvidenceStore(folder, "cam0", 10**12, 0)
    store.open()
    for i in range(count):
        image = noise(i)
        label = Detections(np.array([PROBE_BOX], np.float32), np.array([0.9], np.float32), np.zeros(1, np.int32))
        store.save(
            EvidenceFrame(
                "cam0",
                i,
                t0_ns + i * 10**9,
                image,
                "bgr",
                label.dataset_label(*image.shape[1::-1]),
                b"{}",
                LABELS,
                "detect",
                store.dataset_for("detect", LABELS),
            ),
            95,
        )
    stems = [p.stem for p in sets(folder)][-count:]
    when = time.time() - age_days * 86400
    for stem in stems:
        for path in folder.rglob(f"{stem}.*"):
            os.utime(path, (when, when))
    return stems


def wait_until(predicate: Callable[[], bool], d: RunningDaemon, timeout_s: float = 30) -> bool:
    """Wait for ``predicate`` while the daemon runs; fail with its log when it never holds. A
    predicate walking a folder the daemon is pruning may meet a directory removed under it: that
    is "not yet", and it is asked again."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(FileNotFoundError):
            if predicate():
                return True
        assert d.proc.poll() is None, d.log()
        time.sleep(0.05)
    raise AssertionError(f"never happened in {timeout_s} s:\n{d.log()}")


def test_a_folder_over_its_quota_or_age_is_pruned_at_start_up_oldest_first(workdir: Path) -> None:
    folder = workdir / "evidence"
    old = prefill(folder, 3, t0_ns=time.time_ns() - 60 * 86400 * 10**9, age_days=40)
    recent = prefill(folder, 6, t0_ns=time.time_ns() - 3600 * 10**9, age_days=0)
    each = disk_bytes(folder) // 9
    # Only black images: the daemon saves nothing, so what goes is what start-up pruned.
    d = start(workdir, {"max_bytes": int(each * 3.5), "max_age_days": 30}, images="imgs/001.png")
    try:
        kept = sorted(recent[-3:] * 3)  # image, label and message of each of the newest three
        assert wait_until(lambda: sorted(p.stem for p in folder.rglob("*/*/*/*") if p.is_file()) == kept, d)
        on_disk = disk_bytes(folder)
        assert on_disk <= each * 3.5
        status = d.wait_status(lambda s: s.evidence is not None and s.evidence.bytes == on_disk)  # the running total
        assert evidence_of(status) == (0, 0, 0, 0)
    finally:
        d.close()
    assert not set(old) & {p.stem for p in sets(folder)}
    assert_no_half_sets(folder)


def test_the_quota_holds_while_saving(workdir: Path) -> None:
    folder = workdir / "evidence"
    d = start(workdir, {"max_bytes": 60_000, "max_per_minute": 0})
    try:
        d.wait_status(lambda s: evidence_of(s)[0] >= 10)
        assert d.stop() == 0
    finally:
        d.close()
    assert 1 <= len(sets(folder)) < 10 and disk_bytes(folder) <= 60_000
    assert_no_half_sets(folder)


def test_the_rate_limit_saves_at_most_max_per_minute_and_counts_the_rest(workdir: Path) -> None:
    d = start(workdir, {"max_per_minute": 3})
    try:
        d.wait_status(lambda s: evidence_of(s)[3] >= 5 and evidence_of(s)[0] == 3)
        d.collect("detections", 5)
        assert d.stop() == 0
    finally:
        d.close()
    assert len(sets(workdir / "evidence")) == 3
    assert "evidence.max_per_minute (3) reached" in d.log_path.read_text()


def limit_file_size(pid: int) -> None:
    """No file the daemon writes may grow past 8 KB (a saved image is tens of KB). Python ignores
    SIGXFSZ, so the write fails with EFBIG instead of killing it. Set from outside as soon as it
    starts, long before its first frame: a preexec_fn may deadlock a child forked beside threads."""
    resource.prlimit(pid, resource.RLIMIT_FSIZE, (8192, 8192))


@pytest.mark.parametrize("full", ["small filesystem", "file size limit"])
def test_a_full_disk_is_counted_and_logged_once_while_inspection_goes_on(workdir: Path, full: str) -> None:
    folder = workdir / "evidence"
    with tmpfs(folder, "size=64k") if full == "small filesystem" else contextlib.nullcontext(False) as mounted:
        if full == "small filesystem" and not mounted:
            pytest.skip("this process may not mount a tmpfs")
        d = start(workdir, {"max_per_minute": 0})
        if not mounted:
            limit_file_size(d.proc.pid)
        try:
            status = d.wait_status(lambda s: evidence_of(s)[2] >= 5)
            detections = d.collect("detections", 5)  # still inspecting, after the errors
            assert all(m.detections for m in detections if isinstance(m, DetectionsMessage) and m.frame_id % 2 == 0)
            later = d.wait_status(lambda s: evidence_of(s)[2] > evidence_of(status)[2])
            assert later.evidence is not None and later.evidence.last_error is not None
            assert ("disk is full" if mounted else "file size limit") in later.evidence.last_error
            assert d.stop() == 0
        finally:
            d.close()
        assert d.log_path.read_text().count("evidence not saved") == 1
        assert_no_half_sets(folder)


def test_a_read_only_folder_is_counted_and_saving_resumes_once_it_is_writable(workdir: Path) -> None:
    folder = workdir / "evidence"
    with read_only_folder(folder):
        d = start(workdir, {"max_per_minute": 0})
        try:
            d.wait_status(lambda s: evidence_of(s)[2] >= 5 and evidence_of(s)[0] == 0)
            d.collect("detections", 5)
        except BaseException:
            d.close()
            raise
    try:  # writable again: the mount is gone, or the mode restored
        d.wait_status(lambda s: evidence_of(s)[0] >= 2)
        assert d.stop() == 0
    finally:
        d.close()
    log = d.log_path.read_text()
    assert log.count("evidence not saved") == 1 and "evidence saved again" in log
    assert len(sets(folder)) >= 2


def test_sighup_turns_evidence_off_and_on_again_in_another_folder(workdir: Path) -> None:
    path, endpoint = configure(workdir, {"max_per_minute": 0})
    d = RunningDaemon(path, endpoint)
    try:
        d.wait_status(lambda s: evidence_of(s)[0] >= 2)
        configure(workdir, None, endpoint=endpoint)
        d.signal(signal.SIGHUP)
        off = d.wait_status(lambda s: s.evidence is None)
        d.wait_status(lambda s: s.frames_processed >= off.frames_processed + 10)  # the old writer's queue done
        before = len(sets(workdir / "evidence"))
        d.wait_status(lambda s: s.frames_processed >= off.frames_processed + 20)  # frames go by, none saved
        assert len(sets(workdir / "evidence")) == before
        configure(workdir, {"dir": "evidence2", "max_per_minute": 0}, endpoint=endpoint)
        d.signal(signal.SIGHUP)
        d.wait_status(lambda s: evidence_of(s)[0] >= 2)
        assert len(sets(workdir / "evidence2")) >= 2 and len(sets(workdir / "evidence")) == before
    finally:
        d.close()


def test_a_reload_from_a_detector_to_a_classifier_leaves_each_models_evidence_a_dataset_of_its_own(
    workdir: Path,
) -> None:
    shutil.copy(TASKS / "cls.onnx", workdir / "cls.onnx")
    keys: dict[str, object] = {"save": "all", "max_per_minute": 0}
    path, endpoint = configure(workdir, keys)
    evidence = workdir / "evidence"
    d = RunningDaemon(path, endpoint)
    try:
        d.wait_status(lambda s: evidence_of(s)[0] >= 4)
        configure(workdir, keys, endpoint=endpoint, model="cls.onnx")  # the same [evidence], another task
        d.signal(signal.SIGHUP)
        labels = set()
        for msg in d.messages(30):
            if isinstance(msg, DetectionsMessage) and msg.task == "classify" and msg.top:
                labels.add(msg.top[0].label)
                if len(labels) >= 2:
                    break
        assert labels, d.log()
        wait_until(lambda: len(list(evidence.glob("*/*/images/*/*.jpg"))) >= 4, d)
        assert d.stop() == 0
    finally:
        d.close()
    folders = sorted(p.name for p in evidence.iterdir())
    assert len(folders) == 2 and folders[0] == "cam0" and re.fullmatch(r"cam0@classify-[0-9a-f]{8}", folders[1]), folders
    detector, classifier = (evidence / name for name in folders)
    # The detector's dataset: its names, every image with its label file beside it, no class folder.
    assert json.loads((detector / "dataset.json").read_text()) == {"task": "detect", "names": list(LABELS)}
    assert tuple((detector / "classes.txt").read_text().splitlines()) == LABELS
    assert [line for line in (detector / "data.yaml").read_text().splitlines() if line.startswith("  ")] == [
        f'  {i}: "{name}"' for i, name in enumerate(LABELS)
    ]
    detected = sorted(detector.rglob("*.jpg"))
    assert len(detected) >= 4 and all(p.parent.name == "images" for p in detected)
    assert len(list(folder_samples(detector, len(LABELS))[1])) == len(detected)
    # The classifier's: its names, every image in the folder of its class, no label file.
    record = json.loads((classifier / "dataset.json").read_text())
    names = tuple(record["names"])
    assert record["task"] == "classify" and tuple((classifier / "classes.txt").read_text().splitlines()) == names
    assert labels <= set(names)
    classified = sorted(classifier.rglob("*.jpg"))
    assert len(classified) >= 4 and not list(classifier.rglob("labels/*.txt"))
    for image in classified:
        assert image.parent.parent.name == "images" and image.parent.name in {class_folder(n) for n in names}
        message = parse_message((image.parents[2] / "messages" / f"{image.stem}.json").read_bytes())
        assert isinstance(message, DetectionsMessage) and message.top
        assert class_folder(message.top[0].label) == image.parent.name
    assert_no_half_sets(evidence)


def cameras(workdir: Path, camera_ids: list[str], endpoint: str | None = None) -> tuple[Path, str]:
    """A configuration of one camera per id, each on the images, saving every frame to ``evidence``."""
    endpoint = endpoint or f"tcp://127.0.0.1:{free_port()}"
    doc: dict[str, dict[str, object] | list[dict[str, object]]] = {
        "source": [{"type": "images", "path": "imgs", "fps": 20.0, "camera_id": name} for name in camera_ids],
        "model": {"path": "probe.onnx"},
        "publish": {"endpoints": [endpoint], "status_interval_s": 0.3},
        "thermal": {"enabled": False},
        "evidence": {"dir": "evidence", "save": "all", "max_per_minute": 0},
    }
    return write_config(workdir / "edged.toml", doc), endpoint


def test_two_cameras_whose_evidence_folders_are_one_are_refused_by_check_and_run_naming_both(workdir: Path) -> None:
    # A user moved camera line1's evidence by a link, to Line1's folder: retention of each would delete the other's.
    evidence = workdir / "evidence"
    (evidence / "Line1").mkdir(parents=True)
    (evidence / "line1").symlink_to("Line1")
    config, endpoint = cameras(workdir, ["Line1", "line1", "cam2"])  # cam2's folder is made to be compared
    for said in refused_by_check_and_run(config, endpoint, "--no-bind"):
        assert (
            f"evidence.dir: {evidence}/line1 and {evidence}/Line1, the evidence folders of cameras line1 and Line1, "
            f"are one folder: {evidence}/line1 is a link to {evidence}/Line1; their frames would mix and each "
            f"camera's retention would delete the other's: give one camera another camera_id, or remove the link "
            f"{evidence}/line1"
        ) in said, said
    assert not list((evidence / "Line1").iterdir())
    assert not (evidence / "cam2").exists()  # made for the comparison, removed with the refusal (before: kept by run)


def test_cameras_alike_but_for_case_save_apart_and_a_reload_giving_two_one_folder_is_refused(workdir: Path) -> None:
    evidence = workdir / "evidence"
    config, endpoint = cameras(workdir, ["Line1", "line1"])
    d = RunningDaemon(config, endpoint)
    try:
        for name in ("Line1", "line1"):  # apart on a drive that tells case apart, as most do
            d.wait_status(lambda s, name=name: s.camera_id == name and evidence_of(s)[0] >= 2)
        (evidence / "LINE1").symlink_to("Line1")
        cameras(workdir, ["Line1", "line1", "LINE1"], endpoint)
        d.signal(signal.SIGHUP)
        wait_until(lambda: "reload refused" in d.log(), d)
        refused = d.log().split("reload refused", 1)[1]
        assert f"cameras LINE1 and Line1, are one folder: {evidence}/LINE1 is a link" in refused, refused
        served = d.wait_status(lambda s: s.camera_id == "line1")  # the running configuration serves on
        d.wait_status(lambda s: s.camera_id == "line1" and s.frames_processed >= served.frames_processed + 5)
        assert d.stop() == 0
    finally:
        d.close()
    assert "camera LINE1" not in d.log_path.read_text()
    for name in ("Line1", "line1"):
        stems = [p.stem for p in (evidence / name).rglob("*.jpg")]
        assert stems and all(stem.startswith(f"{name}_") for stem in stems), (name, stems)
