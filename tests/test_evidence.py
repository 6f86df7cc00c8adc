"""Evidence images: the save policy, the files on disk, atomic saves, retention, the writer's bounds."""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import subprocess
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Literal

import cv2
import numpy as np
import pytest
from allocations import NumpyAllocations
from filesystems import read_only_folder
from waiting import wait_for

from edged.classify import Classes
from edged.config import Settings, load_config
from edged.decode import Detections
from edged.errors import ConfigError
from edged.evidence import (
    CLOCK_RECORD,
    QUEUE_FRAMES,
    EvidenceFrame,
    EvidenceOutput,
    EvidenceStore,
    EvidenceWriter,
    alike_classes,
    class_folder,
    data_yaml,
    dataset_name,
    day_and_stem,
    describe,
    folder_problem,
    should_save,
    write_atomic,
)
from edged.files import MadeFolders
from edged.identity import boot_id
from edged.messages import Task
from edged.output import Services
from edged.settings.evidence import EvidenceConfig, default_dir
from edged.sources.base import Frame
from edged.tools.evaluate import folder_samples, label_path, read_yolo_labels

T0_NS = 1_796_000_000_000_000_000  # 2026-11-30 00:53:20 UTC
NAMES = ("scratch", "dent", "2026-12-03", 'say "no"')  # a date-like and a quoted name: both must stay strings
DAY_NS = 86400 * 10**9


def frame(
    frame_id: int = 1,
    *,
    t_ns: int = T0_NS,
    size: tuple[int, int] = (128, 96),
    order: Literal["bgr", "rgb"] = "bgr",
    detections: Detections | None = None,
    message: bytes | None = b'{"frame": 1}',
    noise: bool = False,
    names: tuple[str, ...] = NAMES,
    task: Task = "detect",
    dataset: str = "cam0",
) -> EvidenceFrame:
    w, h = size
    rng = np.random.default_rng(frame_id)
    image = rng.integers(0, 256, (h, w, 3), np.uint8) if noise else np.full((h, w, 3), (10, 20, 200), np.uint8)
    if detections is None:
        detections = detected((1, (10.0, 20.0, 50.0, 60.0)))
    label = detections.dataset_label(w, h)
    return EvidenceFrame("cam0", frame_id, t_ns + frame_id * 10**6, image, order, label, message, names, task, dataset)


def detected(*found: tuple[int, tuple[float, float, float, float]]) -> Detections:
    """Detections of these classes and boxes, as the decoder hands them on."""
    xyxy = np.array([box for _, box in found], np.float32).reshape(-1, 4)
    return Detections(xyxy, np.full(len(found), 0.9, np.float32), np.array([c for c, _ in found], np.int32))


def _offer_grey(w: EvidenceWriter) -> None:
    """One grey frame with nothing detected, offered as the loop offers it."""
    grey = Frame(np.full((96, 128, 3), 50, np.uint8), 1, 0, T0_NS, "bgr")
    w.offer(grey, detected(), None, b"{}", names=NAMES, task="detect")


def saved_sets(folder: Path) -> list[str]:
    return sorted(p.stem for p in folder.rglob("images/*.jpg"))


def files_on_disk(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file())


# ---- the policy ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("save", "verdict", "found", "near", "expected"),
    [
        ("all", None, 0, 0, True),
        ("all", "ok", 0, 0, True),
        ("ng", None, 0, 0, False),
        ("ng", None, 1, 0, True),  # no inspection: ng is any detection
        ("ng", None, 0, 2, False),  # near misses are not detections
        ("ng", "ng", 0, 0, True),
        ("ng", "ok", 3, 0, False),  # the verdict decides when there is one
        ("ng", "ok", 3, 1, False),
        ("ng+near", "ok", 3, 1, True),  # a near miss is worth labelling
        ("ng+near", "ok", 3, 0, False),
        ("ng+near", None, 0, 1, True),
        ("ng+near", None, 0, 0, False),
        ("ng+near", "ng", 0, 0, True),
    ],
)
def test_the_save_policy(save: str, verdict: str | None, found: int, near: int, expected: bool) -> None:
    assert should_save(save, verdict, found, near) is expected  # type: ignore[arg-type]


def test_stems_sort_by_capture_time_within_a_day_folder_named_in_utc() -> None:
    day, stem = day_and_stem("cam0", T0_NS + 5 * 10**6, 42)
    assert (day, stem) == ("2026-11-30", "cam0_20261130T005320005_42")
    later = [day_and_stem("cam0", T0_NS + i * 10**9, 1000 - i)[1] for i in range(3)]
    assert later == sorted(later)


def test_a_requests_part_id_ends_the_stem_as_a_safe_file_name() -> None:
    assert day_and_stem("cam0", T0_NS, 42, "A-1017")[1] == "cam0_20261130T005320000_42_A-1017"
    assert day_and_stem("cam0", T0_NS, 42, "../x/y z")[1] == "cam0_20261130T005320000_42_.._x_y_z"
    assert len(day_and_stem("cam0", T0_NS, 42, "P" * 128)[1]) == len("cam0_20261130T005320000_42_") + 64
    assert day_and_stem("cam0", T0_NS, 42, "")[1] == day_and_stem("cam0", T0_NS, 42)[1]


# ---- the files ----------------------------------------------------------------------------------


def test_the_camera_folder_is_a_ready_dataset_with_the_model_s_class_names_in_order(tmp_path: Path) -> None:
    store = EvidenceStore(tmp_path / "ev", "cam0", 10**9, 30)
    store.open()
    store.save(frame(1), 95)
    folder = tmp_path / "ev" / "cam0"
    data = (folder / "data.yaml").read_text()
    settings = [line for line in data.splitlines() if not line.startswith("#")]
    assert settings == [
        'train: "."',
        'val: "."',
        "nc: 4",
        "names:",
        '  0: "scratch"',
        '  1: "dent"',
        '  2: "2026-12-03"',
        '  3: "say \\"no\\""',
    ]
    assert (folder / "classes.txt").read_text() == 'scratch\ndent\n2026-12-03\nsay "no"\n'
    assert json.loads((folder / "dataset.json").read_text()) == {"task": "detect", "names": list(NAMES)}
    assert store.total_bytes == sum(p.stat().st_size for p in files_on_disk(tmp_path))
    reopened = EvidenceStore(tmp_path / "ev", "cam0", 10**9, 30)
    reopened.open()
    assert reopened.total_bytes == store.total_bytes


def test_a_saved_frame_is_a_jpeg_a_yolo_label_and_the_message(tmp_path: Path) -> None:
    store = EvidenceStore(tmp_path / "ev", "cam0", 10**9, 30)
    store.open()
    detections = detected((0, (12.5, 8.0, 40.25, 30.0)), (2, (0.0, 0.0, 128.0, 96.0)))
    store.save(frame(7, detections=detections, message=b'{"seq": 3}'), jpeg_quality=95)
    day, stem = day_and_stem("cam0", T0_NS + 7 * 10**6, 7)
    folder = tmp_path / "ev" / "cam0" / day
    image = cv2.imread(str(folder / "images" / f"{stem}.jpg"))
    assert image.shape == (96, 128, 3)
    assert np.abs(image.astype(int) - (10, 20, 200)).max() <= 3  # the frame as captured, not annotated
    label = folder / "labels" / f"{stem}.txt"
    assert label.read_text().splitlines()[0] == "0 0.206055 0.197917 0.216797 0.229167"
    image_path = folder / "images" / f"{stem}.jpg"
    assert label_path(image_path) == label  # where `edged eval --data` looks
    assert "/labels/".join(str(image_path).rsplit("/images/", 1)).rsplit(".", 1)[0] + ".txt" == str(label)  # ultralytics
    boxes, classes = read_yolo_labels(label, 128, 96, num_classes=3)
    assert classes.tolist() == [0, 2]
    np.testing.assert_allclose(boxes, [[12.5, 8.0, 40.25, 30.0], [0.0, 0.0, 128.0, 96.0]], atol=1e-3)
    assert (folder / "messages" / f"{stem}.json").read_bytes() == b'{"seq": 3}'
    assert not [p for p in files_on_disk(tmp_path) if p.name.endswith(".tmp")]
    assert store.total_bytes == sum(p.stat().st_size for p in files_on_disk(tmp_path))
    [sample] = list(folder_samples(tmp_path / "ev", 3)[1])  # `edged eval --data` reads the folder as it is
    assert sample.class_ids.tolist() == [0, 2]


def test_an_rgb_frame_is_saved_in_its_true_colours_and_an_unpublished_one_without_a_message(tmp_path: Path) -> None:
    store = EvidenceStore(tmp_path, "cam0", 10**9, 30)
    store.open()
    rgb = frame(1, order="rgb", message=None, detections=detected())
    store.save(rgb, jpeg_quality=95)
    [jpg] = list(tmp_path.rglob("*.jpg"))
    assert np.abs(cv2.imread(str(jpg)).astype(int) - (200, 20, 10)).max() <= 3  # BGR on disk
    assert not list(tmp_path.rglob("messages/*.json"))
    assert [p.read_text() for p in tmp_path.rglob("labels/*.txt")] == [""]  # a negative for training


def test_write_atomic_replaces_whole_or_leaves_no_temp_file(tmp_path: Path) -> None:
    path = tmp_path / "a.txt"
    write_atomic(path, b"old")
    write_atomic(path, b"new")
    assert path.read_bytes() == b"new"
    (tmp_path / "b.txt").mkdir()  # the rename onto it fails after the data was written
    with pytest.raises(OSError):
        write_atomic(tmp_path / "b.txt", b"data")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "b.txt"]


def test_start_up_removes_half_written_sets_and_temp_files(tmp_path: Path) -> None:
    store = EvidenceStore(tmp_path, "cam0", 10**9, 30)
    store.open()
    store.save(frame(1), 95)
    store.save(frame(2), 95)
    day = next(p for p in (tmp_path / "cam0").iterdir() if p.is_dir())
    # A power cut after the label and message of a third frame, and in the middle of a fourth.
    (day / "labels" / "cam0_x_3.txt").write_text("0 0.5 0.5 0.1 0.1\n")
    (day / "messages" / "cam0_x_3.json").write_text("{}")
    (day / "images" / ".cam0_x_4.jpg.tmp").write_bytes(b"\xff\xd8 half")
    (day / "labels" / ".cam0_x_4.txt.tmp").write_bytes(b"0 0.")
    reopened = EvidenceStore(tmp_path, "cam0", 10**9, 30)
    reopened.open()
    assert [p.name for p in files_on_disk(tmp_path) if "x_" in p.name] == []
    assert len(saved_sets(tmp_path)) == 2
    assert reopened.total_bytes == sum(p.stat().st_size for p in files_on_disk(tmp_path))


# ---- one dataset per model ----------------------------------------------------------------------

SWAPPED = ("dent", "scratch", "2026-12-03", 'say "no"')  # the same classes in another order: class 0 is now dent
CLASSES = ("good", "crack")


def save_as(
    store: EvidenceStore,
    frame_id: int,
    names: tuple[str, ...] = NAMES,
    task: Task = "detect",
    *,
    t_ns: int = T0_NS,
    noise: bool = False,
) -> Path:
    """A frame of a model of ``task`` and ``names`` saved as the writer saves it; its dataset folder."""
    dataset = store.dataset_for(task, names)
    saved = frame(frame_id, t_ns=t_ns, noise=noise, names=names, task=task, dataset=dataset)
    if task == "classify":
        saved = replace(saved, label="", image_class=class_folder(names[frame_id % len(names)]))
    store.save(saved, 95)
    return store.root / dataset


def described(folder: Path) -> tuple[str, tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    """A dataset folder's task and its names as dataset.json, data.yaml (a detector's or segmenter's
    only: the names of the record where it has none) and classes.txt give them."""
    record = json.loads((folder / "dataset.json").read_text())
    yaml = folder / "data.yaml"
    assert yaml.exists() == (record["task"] in ("detect", "segment"))
    yaml_names = (
        tuple(json.loads(line.split(": ", 1)[1]) for line in yaml.read_text().splitlines() if line.startswith("  "))
        if yaml.exists()
        else tuple(record["names"])
    )
    return record["task"], tuple(record["names"]), yaml_names, tuple((folder / "classes.txt").read_text().splitlines())


def assert_one_dataset(folder: Path, task: str, names: tuple[str, ...], frames: int) -> None:
    """``folder`` is the dataset of one model: described by its names, and every image under it
    filed as that task files it (a label file beside it, or a class folder and none)."""
    assert described(folder) == (task, names, names, names)
    images = sorted(folder.rglob("*.jpg"))
    assert len(images) == frames
    for image in images:
        if task == "classify":
            assert image.parent.parent.name == "images" and image.parent.name in {class_folder(n) for n in names}
            assert not label_path(image).exists()
        else:
            assert image.parent.name == "images" and label_path(image).is_file()
    assert not list(folder.rglob("labels/*.txt")) or task != "classify"


def test_a_model_with_other_class_names_saves_a_dataset_of_its_own_and_the_first_keeps_its_names(
    tmp_path: Path,
) -> None:
    store = EvidenceStore(tmp_path, "cam0", 10**9, 0)
    store.open()
    first = [save_as(store, i) for i in range(2)]
    swapped = [save_as(store, i, SWAPPED) for i in range(2, 5)]  # a reload to a model whose class 0 is dent
    assert set(first) == {tmp_path / "cam0"}
    assert set(swapped) == {tmp_path / dataset_name("cam0", "detect", SWAPPED)} and swapped[0].name.startswith(
        "cam0@detect-"
    )
    assert save_as(store, 5) == tmp_path / "cam0"  # the first model back: its own folder again
    assert_one_dataset(tmp_path / "cam0", "detect", NAMES, 3)
    assert_one_dataset(swapped[0], "detect", SWAPPED, 3)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cam0", swapped[0].name]
    assert len(list(folder_samples(tmp_path / "cam0", 4)[1])) == 3  # `edged eval --data` reads one model's frames
    assert store.total_bytes == sum(p.stat().st_size for p in files_on_disk(tmp_path))
    reopened = EvidenceStore(tmp_path, "cam0", 10**9, 0)
    reopened.open()
    assert reopened.total_bytes == store.total_bytes


def test_a_classifier_after_a_detector_files_its_images_in_a_dataset_of_its_own(tmp_path: Path) -> None:
    store = EvidenceStore(tmp_path, "cam0", 10**9, 0)
    store.open()
    save_as(store, 0)
    classified = save_as(store, 1, CLASSES, "classify")
    same_names = save_as(store, 2, NAMES, "classify")  # the task alone changed: still another dataset
    save_as(store, 3)
    assert classified.name.startswith("cam0@classify-") and same_names.name.startswith("cam0@classify-")
    assert len({classified, same_names, tmp_path / "cam0"}) == 3
    assert_one_dataset(tmp_path / "cam0", "detect", NAMES, 2)
    assert_one_dataset(classified, "classify", CLASSES, 1)
    assert_one_dataset(same_names, "classify", NAMES, 1)
    assert [p.name for p in (tmp_path / "cam0").rglob("images/*")] == [p.name for p in (tmp_path / "cam0").rglob("*.jpg")]


def test_only_a_detection_or_segmentation_dataset_has_a_data_yaml_which_would_train_on_an_anomaly_models_maps(
    tmp_path: Path,
) -> None:
    store = EvidenceStore(tmp_path, "cam0", 10**9, 0)
    store.open()
    anomalous = replace(frame(1, task="anomaly", names=("anomaly",)), heatmap=np.zeros((96, 128), np.uint8))
    store.save(replace(anomalous, dataset=store.dataset_for("anomaly", ("anomaly",))), 95)
    segmented = save_as(store, 2, NAMES, "segment")
    classified = save_as(store, 3, CLASSES, "classify")
    assert list((tmp_path / "cam0").rglob("maps/*.png"))
    assert not (tmp_path / "cam0" / "data.yaml").exists() and not (classified / "data.yaml").exists()
    assert (segmented / "data.yaml").is_file()
    assert_one_dataset(classified, "classify", CLASSES, 1)
    assert store.total_bytes == sum(p.stat().st_size for p in files_on_disk(tmp_path))


def test_each_class_has_a_folder_of_its_own_whatever_its_name() -> None:
    """A classifier's frames are filed under their class's folder: names changed to letters, digits and
    ``_ . -`` alone gave two Japanese classes, or ``a b`` and ``a_b``, one folder, and the dataset made
    of it one class where the model has two."""
    names = ["\u50b7", "\u51f9", "a b", "a_b", "a/b", ".", "..", "x" * 64 + "1", "x" * 64 + "2", "x" * 64, "crack"]
    folders = [class_folder(name) for name in names]
    assert len(set(folders)) == len(names), folders
    assert all(re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", f) and f.strip(".") for f in folders), folders
    assert folders[3] == "a_b" and folders[-2:] == ["x" * 64, "crack"]  # a name that is a folder as it is stays so
    assert folders[0] == class_folder("\u50b7")  # the same name finds its folder again


def test_data_yaml_writes_each_class_name_as_yamls_readers_read_it_back() -> None:
    """JSON's quoting wrote an emoji as two surrogate escapes, which PyYAML (ultralytics' reader)
    reads as two lone surrogates; JSON leaves DEL and C1 controls as they are, which YAML's reader
    refuses."""
    text = data_yaml("cam0", ("ok\U0001f600", "\u50b7", 'a"b\\c#: d', "x\x7f\x9fy", "2026-12-03"))
    assert text.splitlines()[-5:] == [
        '  0: "ok\U0001f600"',
        '  1: "\u50b7"',
        '  2: "a\\"b\\\\c#: d"',
        '  3: "x\\u007f\\u009fy"',
        '  4: "2026-12-03"',
    ]


@pytest.mark.parametrize(
    "written",
    [
        'scratch\r\ndent\r\n2026-12-03\r\nsay "no"\r\n',  # edited on Windows
        '\ufeffscratch\ndent\n2026-12-03\nsay "no"\n',  # saved by an editor that marks UTF-8
        'scratch\ndent\n2026-12-03\nsay "no"\n\n\n',  # blank lines after the names
    ],
)
def test_an_older_camera_folders_classes_txt_as_editors_write_it_still_names_its_model(tmp_path: Path, written: str) -> None:
    (tmp_path / "cam0").mkdir()
    (tmp_path / "cam0" / "classes.txt").write_bytes(written.encode())
    store = EvidenceStore(tmp_path, "cam0", 10**9, 0)
    store.open()
    assert save_as(store, 1) == tmp_path / "cam0"
    assert_one_dataset(tmp_path / "cam0", "detect", NAMES, 1)


@pytest.mark.parametrize("record", ["dataset.json", "classes.txt"])
@pytest.mark.parametrize("kind", ["fifo", "directory", "huge"])
def test_a_record_that_is_a_pipe_a_folder_or_huge_is_another_models_never_a_hang_or_a_failed_save(
    tmp_path: Path, record: str, kind: str
) -> None:
    folder = tmp_path / "cam0"
    folder.mkdir()
    if kind == "fifo":  # reading it waits for a writer that never comes
        os.mkfifo(folder / record)
    elif kind == "directory":  # reading it failed every save, each frame lost
        (folder / record).mkdir()
    else:  # sparse: read whole, a larger one would take as much memory
        with (folder / record).open("wb") as file:
            file.truncate(64 << 20)
    made: list[EvidenceStore] = []
    thread = threading.Thread(target=lambda: made.append(EvidenceStore(tmp_path, "cam0", 10**9, 0)), daemon=True)
    thread.start()
    thread.join(60)
    if thread.is_alive():  # let the reader go before failing
        os.close(os.open(folder / record, os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail(f"a {kind} {record} held up the evidence store")
    (store,) = made
    store.open()
    assert save_as(store, 1) == tmp_path / dataset_name("cam0", "detect", NAMES)
    assert_one_dataset(tmp_path / dataset_name("cam0", "detect", NAMES), "detect", NAMES, 1)


@pytest.mark.parametrize("record", ["dataset.json", "classes.txt"])
def test_a_record_edgeds_user_may_not_read_is_another_models_never_a_failed_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, record: str
) -> None:
    folder = tmp_path / "cam0"
    folder.mkdir()
    (folder / record).write_text("scratch\n")
    (folder / record).chmod(0)
    real_open = os.open

    def denied(path: str | os.PathLike[str], flags: int, *args: int, **kwargs: int | None) -> int:
        if Path(path) == folder / record:  # as for a file of another user's, mode 0600 (root reads any)
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", denied)
    store = EvidenceStore(tmp_path, "cam0", 10**9, 0)
    store.open()
    for frame_id in (1, 2):  # each saved: before, every save failed reading the record
        assert save_as(store, frame_id) == tmp_path / dataset_name("cam0", "detect", NAMES)
    assert_one_dataset(tmp_path / dataset_name("cam0", "detect", NAMES), "detect", NAMES, 2)


def test_across_a_restart_the_camera_folder_keeps_the_model_it_holds_and_an_older_one_is_known_by_its_names(
    tmp_path: Path,
) -> None:
    before = EvidenceStore(tmp_path, "cam0", 10**9, 0)
    before.open()
    save_as(before, 0)
    after = EvidenceStore(tmp_path, "cam0", 10**9, 0)  # restarted with another model
    after.open()
    assert save_as(after, 1, SWAPPED) == tmp_path / dataset_name("cam0", "detect", SWAPPED)
    assert save_as(after, 2, CLASSES, "classify") == tmp_path / dataset_name("cam0", "classify", CLASSES)
    assert_one_dataset(tmp_path / "cam0", "detect", NAMES, 1)
    # A camera folder an older edged wrote has no dataset.json: its classes.txt names its model.
    (tmp_path / "cam0" / "dataset.json").unlink()
    older = EvidenceStore(tmp_path, "cam0", 10**9, 0)
    older.open()
    assert save_as(older, 3, SWAPPED) == tmp_path / dataset_name("cam0", "detect", SWAPPED)
    assert save_as(older, 4) == tmp_path / "cam0"
    assert_one_dataset(tmp_path / "cam0", "detect", NAMES, 2)
    assert older.total_bytes == sum(p.stat().st_size for p in files_on_disk(tmp_path))


def test_a_camera_folder_found_holding_another_models_evidence_is_refused_not_relabelled(tmp_path: Path) -> None:
    late = EvidenceStore(tmp_path, "cam0", 10**9, 0)  # made while the folder was missing (a drive not yet mounted)
    other = EvidenceStore(tmp_path, "cam0", 10**9, 0)
    other.open()
    save_as(other, 0)
    late.open()
    with pytest.raises(OSError, match="holds the evidence of the detect model with classes scratch, dent") as refused:
        save_as(late, 1, CLASSES, "classify")
    assert "the frame is not saved" in describe(refused.value)
    assert_one_dataset(tmp_path / "cam0", "detect", NAMES, 1)
    assert save_as(late, 2, CLASSES, "classify") == tmp_path / dataset_name("cam0", "classify", CLASSES)
    (tmp_path / "cam0" / "dataset.json").write_text("{not json")  # unreadable: no model's folder
    assert EvidenceStore(tmp_path, "cam0", 10**9, 0).dataset_for("detect", NAMES) == dataset_name("cam0", "detect", NAMES)
    with pytest.raises(OSError, match=r"the evidence of a model its dataset\.json or classes\.txt does not name readably"):
        save_as(late, 3)  # the store has not read the record since it was made


def test_retention_and_start_up_cleaning_cover_every_dataset_of_the_camera(tmp_path: Path) -> None:
    (tmp_path / "cam1").mkdir()
    (tmp_path / "cam1" / "kept.txt").write_text("another camera's")  # neither counted nor pruned
    store = EvidenceStore(tmp_path, "cam0", 10**12, 0)
    store.open()
    for i in range(9):  # three days, each with frames of both models
        save_as(
            store, i, *((CLASSES, "classify") if i % 2 else (NAMES, "detect")), t_ns=T0_NS + (i // 3) * DAY_NS, noise=True
        )
    classified = tmp_path / dataset_name("cam0", "classify", CLASSES)
    day0, day2 = (day_and_stem("cam0", T0_NS + d * DAY_NS, 0)[0] for d in (0, 2))
    (classified / day2 / "images" / "crack" / ".x.jpg.tmp").write_bytes(b"half")  # a power cut's leftovers
    (classified / day2 / "messages" / "cam0_x_9.json").write_text("{}")
    on_disk = sum(p.stat().st_size for p in files_on_disk(tmp_path / "cam0")) + sum(
        p.stat().st_size for p in files_on_disk(classified)
    )
    reopened = EvidenceStore(tmp_path, "cam0", 10**12, 0)
    reopened.open()
    assert not list(tmp_path.rglob("*.tmp")) and not list(tmp_path.rglob("cam0_x_9.json"))
    assert reopened.total_bytes == on_disk - len(b"half") - len(b"{}")
    each = reopened.total_bytes // 9
    reopened.max_bytes = reopened.total_bytes - 4 * each - each // 2  # room for the newest four and a half sets
    assert reopened.prune(time.time()) == 5
    assert sorted(int(p.stem.rsplit("_", 1)[1]) for p in tmp_path.rglob("*.jpg")) == [5, 6, 7, 8]  # oldest first
    assert not (classified / day0).exists() and not (tmp_path / "cam0" / day0).exists()
    assert reopened.total_bytes == sum(p.stat().st_size for p in files_on_disk(tmp_path)) - len("another camera's")
    assert (tmp_path / "cam1" / "kept.txt").is_file()


# ---- retention ----------------------------------------------------------------------------------


def test_the_quota_deletes_the_oldest_frames_first_from_a_running_total(tmp_path: Path) -> None:
    store = EvidenceStore(tmp_path, "cam0", 10**9, 0)
    store.open()
    store.save(frame(0, noise=True), 95)
    one_set = store.total_bytes
    store.max_bytes = int(one_set * 3.5)
    # Frames over three days, saved in time order: day 0, then day 1, then day 2.
    for i in range(1, 9):
        store.save(frame(i, t_ns=T0_NS + (i // 3) * DAY_NS, noise=True), 95)
        store.prune(time.time())
        assert store.total_bytes <= store.max_bytes
        assert store.total_bytes == sum(p.stat().st_size for p in files_on_disk(tmp_path))
    expected = [day_and_stem("cam0", T0_NS + (i // 3) * DAY_NS + i * 10**6, i)[1] for i in (6, 7, 8)]
    assert saved_sets(tmp_path) == expected
    # Emptied days removed; the dataset's description and the clock its images are stamped on stay.
    assert sorted(p.name for p in (tmp_path / "cam0").iterdir()) == [
        ".edged-clock.json",
        "2026-12-02",
        "classes.txt",
        "data.yaml",
        "dataset.json",
    ]


def test_a_classifiers_frames_are_filed_by_class_kept_in_the_quota_and_cleaned_at_start_up(tmp_path: Path) -> None:
    store = EvidenceStore(tmp_path, "cam0", 10**9, 0)
    store.open()
    classes = ["good", "crack/deep", "good", "crack/deep"]  # a class name is made a safe folder name
    for i, name in enumerate(classes):
        store.save(
            replace(frame(i, t_ns=T0_NS + (i // 2) * DAY_NS, noise=True), label="", image_class=class_folder(name)), 95
        )
    day0, day1 = (tmp_path / "cam0" / day_and_stem("cam0", T0_NS + d * DAY_NS, 0)[0] for d in (0, 1))
    deep = class_folder("crack/deep")  # crack_deep-HASH (`test_each_class_has_a_folder_of_its_own_whatever_its_name`)
    assert sorted(p.relative_to(day0).parent.as_posix() for p in day0.rglob("*.jpg")) == [f"images/{deep}", "images/good"]
    assert not list(tmp_path.rglob("labels/*.txt"))  # the folder is the label
    assert len(list(tmp_path.rglob("messages/*.json"))) == 4
    assert store.total_bytes == sum(p.stat().st_size for p in files_on_disk(tmp_path))
    (day1 / "images" / "good" / ".x.jpg.tmp").write_bytes(b"half")  # a power cut's leftover
    day0_bytes = sum(p.stat().st_size for p in files_on_disk(day0))
    reopened = EvidenceStore(tmp_path, "cam0", store.total_bytes - day0_bytes, 0)
    reopened.open()  # over the quota: the oldest day goes, class folders and all
    assert not day0.exists() and not list(tmp_path.rglob("*.tmp"))
    assert sorted(p.parent.name for p in day1.rglob("*.jpg")) == [deep, "good"]
    assert reopened.total_bytes == sum(p.stat().st_size for p in files_on_disk(tmp_path))


def test_a_classifier_whose_classes_differ_only_in_case_saves_none_where_the_drive_takes_them_for_one(
    tmp_path: Path,
) -> None:
    names = ("OK", "ok", "scratch", "Ok", "Scratch.", "dent")
    assert alike_classes(names) == (("OK", "ok"), ("OK", "Ok"), ("scratch", "Scratch."))  # FAT drops the dot
    assert alike_classes(NAMES) == () and alike_classes(("a b", "A_B")) == ()  # their folders: hashed apart

    def classified(i: int) -> EvidenceFrame:
        kept = frame(i, names=names, task="classify")
        return replace(kept, label="", image_class=class_folder(names[i % len(names)]))

    store = EvidenceStore(tmp_path, "cam0", 10**9, 0)
    store.open()
    for i in range(len(names)):  # apart on a drive that tells case apart, as most do
        store.save(classified(i), 95)
    day = tmp_path / "cam0" / day_and_stem("cam0", T0_NS, 0)[0]
    assert sorted(p.parent.name for p in day.rglob("*.jpg")) == sorted(names)
    # As a FAT or exFAT drive does, the dataset folder takes DATASET.JSON for dataset.json.
    (tmp_path / "cam0" / "DATASET.JSON").symlink_to("dataset.json")
    before = files_on_disk(tmp_path)
    for i in (4, 5):  # a class alike another, and one that is not: the model's frames are filed by class nowhere
        with pytest.raises(OSError, match="classes OK and ok of the classify model would share one folder") as info:
            store.save(classified(i), 95)
        assert "rename one of the classes, or point evidence.dir at a drive that tells case apart" in str(info.value)
    assert files_on_disk(tmp_path) == before


def test_a_folder_left_over_the_quota_is_pruned_at_start_up(tmp_path: Path) -> None:
    writer_store = EvidenceStore(tmp_path, "cam0", 10**12, 0)
    writer_store.open()
    for i in range(6):
        writer_store.save(frame(i, t_ns=T0_NS + (i // 2) * DAY_NS, noise=True), 95)
    each = writer_store.total_bytes // 6
    store = EvidenceStore(tmp_path, "cam0", each * 2 + each // 2, 0)
    store.open()
    assert [s.rsplit("_", 1)[1] for s in saved_sets(tmp_path)] == ["4", "5"]
    assert store.total_bytes == sum(p.stat().st_size for p in files_on_disk(tmp_path))


def test_frames_older_than_max_age_are_deleted_at_start_up_and_after_saves(tmp_path: Path) -> None:
    store = EvidenceStore(tmp_path, "cam0", 10**12, 30)
    store.open()
    for i in range(4):
        store.save(frame(i), 95)
    now = time.time()
    for i, stem in enumerate(saved_sets(tmp_path)[:2]):
        for path in tmp_path.rglob(f"{stem}.*"):
            os.utime(path, (now - (40 - i) * 86400, now - (40 - i) * 86400))
    reopened = EvidenceStore(tmp_path, "cam0", 10**12, 30)
    reopened.open()
    assert [s.rsplit("_", 1)[1] for s in saved_sets(tmp_path)] == ["2", "3"]
    assert reopened.prune(now + 31 * 86400) == 2  # a month later, on the writer's idle wake
    assert saved_sets(tmp_path) == []
    assert reopened.total_bytes == sum(p.stat().st_size for p in files_on_disk(tmp_path))  # data.yaml, classes.txt


def test_after_a_clock_stepped_back_from_the_future_the_quota_deletes_the_frames_it_stamped_first(tmp_path: Path) -> None:
    """A board set wrongly four years ahead saves evidence to its quota; stepped back, every frame it
    saves now is named before those (the names sort by capture time). Those from the future were
    saved first, and go first (before: each new frame went at the save after it, and the folder kept
    only what the wrong clock had stamped)."""
    future_ns = time.time_ns() + 4 * 365 * DAY_NS
    store = EvidenceStore(tmp_path, "cam0", 10**9, 30)
    store.open()
    for i in range(3):
        store.save(frame(i, t_ns=future_ns, noise=True), 95)
    store.max_bytes = int(store.total_bytes * 1.2)
    stepped_back = [frame(i, t_ns=time.time_ns(), noise=True) for i in range(3, 6)]
    for saved in stepped_back:
        store.save(saved, 95)
        store.prune(time.time())
        assert store.total_bytes <= store.max_bytes
    kept = [day_and_stem("cam0", f.capture_time_ns, f.frame_id)[1] for f in stepped_back]
    assert set(kept) <= set(saved_sets(tmp_path)), saved_sets(tmp_path)


# ---- the writer -------------------------------------------------------------------------------


def writer(tmp_path: Path, **keys: object) -> EvidenceWriter:
    return EvidenceWriter(EvidenceConfig.model_validate({"dir": str(tmp_path / "ev"), **keys}), "cam0")


def test_a_full_queue_drops_and_counts_and_the_queued_frames_are_saved(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="edged.evidence")
    w = writer(tmp_path, save="all", max_per_minute=0)
    admitted = 0
    for i in range(10):  # the thread has not started: nothing leaves the queue
        if w.admit(None, 0, 0):
            w.submit(frame(i))
            admitted += 1
    assert (admitted, w.dropped) == (QUEUE_FRAMES, 10 - QUEUE_FRAMES)
    assert [r.getMessage() for r in caplog.records if "dropped" in r.getMessage()] == [
        "evidence: the disk is behind the frames to save (4 queued): frames are dropped and counted"
    ]
    w.start()
    w.stop(timeout_s=10)
    report = w.report()
    assert (report.saved, report.dropped, report.errors) == (QUEUE_FRAMES, 10 - QUEUE_FRAMES, 0)
    assert len(saved_sets(tmp_path)) == QUEUE_FRAMES
    assert report.bytes == sum(p.stat().st_size for p in files_on_disk(tmp_path))


def test_a_frame_is_copied_only_when_it_is_evidence_and_then_once(tmp_path: Path) -> None:
    counter = NumpyAllocations.get()
    assert counter is not None, "numpy's allocator hook is unavailable"
    w = writer(tmp_path, save="ng", max_per_minute=0)
    captured = Frame(np.full((96, 128, 3), 50, np.uint8), 1, 0, T0_NS, "bgr")
    nothing = Detections(np.zeros((0, 4), np.float32), np.zeros(0, np.float32), np.zeros(0, np.int32))
    spot = Detections(np.array([[10, 20, 50, 60]], np.float32), np.array([0.8], np.float32), np.array([1], np.int32))
    with counter.counting():
        before = counter.buffers
        w.offer(captured, nothing, None, b"{}", names=NAMES, task="detect")
        assert counter.buffers == before  # not evidence: the loop copies nothing
        w.offer(captured, spot, None, b"{}", names=NAMES, task="detect")
        assert counter.buffers == before + 1  # evidence: the frame, copied once
    captured.image[:] = 0  # the capture slot is reused by the next frame
    w.start()
    w.stop(timeout_s=10)
    [jpg] = list(tmp_path.rglob("*.jpg"))
    assert w.saved == 1 and np.abs(cv2.imread(str(jpg)).astype(int) - 50).max() <= 2
    assert [p.read_text() for p in tmp_path.rglob("labels/*.txt")] == ["1 0.234375 0.416667 0.312500 0.416667\n"]


def test_under_ng_near_a_near_miss_alone_keeps_a_frame_whose_labels_are_its_detections(tmp_path: Path) -> None:
    w = writer(tmp_path, save="ng+near", max_per_minute=0)
    captured = Frame(np.full((96, 128, 3), 50, np.uint8), 1, 0, T0_NS, "bgr")
    nothing = Detections(np.zeros((0, 4), np.float32), np.zeros(0, np.float32), np.zeros(0, np.int32))
    near = Detections(np.array([[10, 20, 50, 60]], np.float32), np.array([0.2], np.float32), np.array([1], np.int32))
    w.offer(captured, nothing, "ok", b"{}", names=NAMES, task="detect")
    w.offer(
        captured,
        Detections(nothing.xyxy, nothing.scores, nothing.class_ids, near=near),
        "ok",
        b"{}",
        names=NAMES,
        task="detect",
    )
    w.start()
    w.stop(timeout_s=10)
    assert w.saved == 1 and len(saved_sets(tmp_path)) == 1
    assert [p.read_text() for p in tmp_path.rglob("labels/*.txt")] == [""]  # the near miss is no label


def test_the_path_a_frame_is_offered_at_is_where_each_models_frame_is_saved(tmp_path: Path) -> None:
    w = writer(tmp_path, save="all", max_per_minute=0)
    w.start()
    try:
        image = np.full((96, 128, 3), 50, np.uint8)
        detector = w.offer(Frame(image, 1, 0, T0_NS, "bgr"), detected(), None, b"{}", names=NAMES, task="detect")
        best = Classes(np.array([1], np.int64), np.array([0.9], np.float32))
        classifier = w.offer(Frame(image, 2, 0, T0_NS, "bgr"), best, None, b"{}", names=CLASSES, task="classify")
        assert wait_for(lambda: w.saved == 2, timeout_s=10)
    finally:
        w.stop(timeout_s=5)
    day = day_and_stem("cam0", T0_NS, 1)[0]
    assert detector is not None and detector.parent == tmp_path / "ev" / "cam0" / day / "images" and detector.is_file()
    classified = tmp_path / "ev" / dataset_name("cam0", "classify", CLASSES)
    assert classifier is not None and classifier.parent == classified / day / "images" / "crack" and classifier.is_file()


@pytest.mark.parametrize("size", [(2, 65535), (65501, 1)])
def test_a_frame_with_a_side_longer_than_a_jpeg_holds_is_saved_as_a_png_as_captured_and_kept_in_the_quota(
    tmp_path: Path, size: tuple[int, int]
) -> None:
    # An image folder's frame may be 65535 on a side, a JPEG at most 65500: saved as JPEG, every such
    # frame failed ("OpenCV could not encode"), counted and logged each time the folder reached it.
    w, h = size
    tall = np.random.default_rng(0).integers(0, 256, (h, w, 3), np.uint8)
    small = np.full((96, 128, 3), 50, np.uint8)
    found = detected((1, (w / 4, h / 4, w * 3 / 4, h * 3 / 4)))
    saving = writer(tmp_path, save="all", max_per_minute=0)
    saving.start()
    try:
        paths = [
            saving.offer(Frame(image, i, 0, T0_NS + i * 10**6, "bgr"), boxes, None, b"{}", names=NAMES, task="detect")
            for i, (image, boxes) in enumerate(((tall, found), (small, detected()), (tall, found)))
        ]
        assert wait_for(lambda: saving.saved + saving.report().errors == 3, timeout_s=10)
    finally:
        saving.stop(timeout_s=5)
    assert (saving.saved, saving.report().errors) == (3, 0), saving.report().last_error
    assert [p.suffix for p in paths if p is not None] == [".png", ".jpg", ".png"]
    first, _, last = (p for p in paths if p is not None)
    assert first.is_file() and np.array_equal(cv2.imread(str(first)), tall)  # the frame as captured
    assert label_path(first).read_text() == found.dataset_label(w, h)  # where ultralytics and `edged eval` look
    read = {s.name: s for s in folder_samples(tmp_path / "ev", len(NAMES))[1]}  # as `edged eval --data` reads it
    assert read[str(first.relative_to(tmp_path / "ev"))].class_ids.tolist() == [1]
    store = EvidenceStore(tmp_path / "ev", "cam0", 10**12, 0)
    store.open()
    store.max_bytes = store.total_bytes - 1  # over the quota: the oldest sets go, the PNG first
    assert store.prune(time.time()) >= 1
    assert not first.exists() and not label_path(first).exists() and last.is_file()
    assert store.total_bytes == sum(p.stat().st_size for p in files_on_disk(tmp_path))


def test_the_rate_limit_counts_the_frames_it_refuses(tmp_path: Path) -> None:
    w = writer(tmp_path, save="ng", max_per_minute=3)
    results = [w.admit(None, 1, 0) for _ in range(10)]
    assert results == [True] * 3 + [False] * 7
    assert (w.rate_limited, w.dropped) == (7, 0)
    assert not w.admit(None, 0, 0)  # not evidence at all: neither saved nor counted
    assert w.rate_limited == 7


def test_a_read_only_or_missing_folder_is_logged_once_per_burst_and_counted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="edged.evidence")
    root = tmp_path / "drive" / "evidence"
    w = EvidenceWriter(EvidenceConfig(dir=root, save="all", max_per_minute=0), "cam0")
    w.start()
    try:
        for i in range(3):  # the drive is not there: its parent folder is missing
            assert w.admit(None, 0, 0)
            w.submit(frame(i))
            assert wait_for(lambda i=i: w.failures.count >= i + 2, timeout_s=10)  # + the start-up scan
        assert "folder is missing" in (w.failures.last or "")
        with read_only_folder(tmp_path / "drive") as code:
            for i in range(3, 6):
                assert w.admit(None, 0, 0)
                w.submit(frame(i))
                assert wait_for(lambda i=i: w.failures.count >= i + 2, timeout_s=10)
            assert describe(OSError(code, "x")).split(" (")[0] in (w.failures.last or "")
        for i in range(6, 8):
            assert w.admit(None, 0, 0)
            w.submit(frame(i))
        assert wait_for(lambda: w.saved == 2, timeout_s=10)
    finally:
        w.stop(timeout_s=10)
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "inference goes on" in errors[0].getMessage()
    assert any("saved again" in r.getMessage() for r in caplog.records)
    assert w.report().errors == 7 and len(saved_sets(root)) == 2


# ---- configuration ----------------------------------------------------------------------------


def test_the_folder_defaults_to_the_state_directory_and_a_relative_one_is_beside_the_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = tmp_path / "state" / "cam3"
    state.mkdir(parents=True)
    monkeypatch.setenv("STATE_DIRECTORY", str(state))
    assert default_dir() == state / "evidence"
    (tmp_path / "m.onnx").write_bytes(b"x")
    config = tmp_path / "edged.toml"
    config.write_text('[model]\npath = "m.onnx"\n[evidence]\nsave = "all"\n')
    settings = load_config(config)
    assert settings.evidence is not None and settings.evidence.dir == state / "evidence"
    monkeypatch.delenv("STATE_DIRECTORY")
    monkeypatch.chdir("/")
    # Outside systemd there is no state directory: beside the configuration file, not where edged was started.
    settings = load_config(config)
    assert settings.evidence is not None and settings.evidence.dir == tmp_path / "evidence"
    assert settings.evidence_dir_default(settings.source[0])
    config.write_text('[model]\npath = "m.onnx"\n[source]\ntype = "synthetic"\n[source.evidence]\nsave = "all"\n')
    settings = load_config(config)
    own = settings.evidence_for(settings.source[0])
    assert own is not None and own.dir == tmp_path / "evidence" and own.save == "all"
    assert EvidenceConfig().dir == Path("/evidence")  # made without a configuration file: the working directory
    config.write_text('[model]\npath = "m.onnx"\n')
    assert load_config(config).evidence is None
    config.write_text('[model]\npath = "m.onnx"\n[evidence]\ndir = "evidence"\nsave = "ng+near"\n')
    settings = load_config(config)
    assert settings.evidence is not None and settings.evidence.dir == tmp_path / "evidence"
    assert not settings.evidence_dir_default(settings.source[0])


def test_a_default_folder_that_cannot_be_made_says_it_is_the_default_and_how_to_set_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR, logger="edged.evidence")
    w = EvidenceWriter(EvidenceConfig(dir=tmp_path / "gone" / "evidence"), "cam0", default_dir=True)
    w.start()
    try:
        assert wait_for(lambda: w.failures.count >= 1, timeout_s=10)  # the start-up scan
    finally:
        w.stop(timeout_s=10)
    (error,) = [r.getMessage() for r in caplog.records]
    assert "folder is missing" in error
    assert "evidence.dir is not set, so this is its default" in error and "set evidence.dir to a folder" in error


@pytest.mark.parametrize(
    ("tables", "problem"),
    [
        ('[evidence]\ndir = "m.onnx"\n', "evidence.dir: {tmp}/m.onnx is a file; give a folder"),
        (
            '[evidence]\ndir = "m.onnx/evidence"\n',
            "evidence.dir: {tmp}/m.onnx is a file, so {tmp}/m.onnx/evidence cannot be made under it; give a folder",
        ),
        (
            '[source]\ntype = "synthetic"\n[source.evidence]\ndir = "m.onnx"\n',
            "source.evidence.dir: {tmp}/m.onnx is a file; give a folder",
        ),
        ('[evidence]\ndir = "/dev/null"\n', "evidence.dir: /dev/null is not a folder; give a folder"),
        (
            '[model.candidate]\npath = "m.onnx"\nevidence_dir = "m.onnx/trial"\n',
            "model.candidate.evidence_dir: {tmp}/m.onnx is a file, so {tmp}/m.onnx/trial cannot be made under it; "
            "give a folder",
        ),
        (
            '[evidence]\nsave = "all"\n',
            "evidence.dir: {tmp}/evidence is a file; evidence.dir is not set, so this is its default",
        ),
    ],
)
def test_an_evidence_folder_that_is_a_file_is_refused_when_the_config_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tables: str, problem: str
) -> None:
    monkeypatch.delenv("STATE_DIRECTORY", raising=False)
    (tmp_path / "m.onnx").write_bytes(b"x")
    (tmp_path / "evidence").write_bytes(b"")  # where the default folder would go
    config = tmp_path / "edged.toml"
    config.write_text('[model]\npath = "m.onnx"\n' + tables)
    with pytest.raises(ConfigError) as info:
        load_config(config)
    (got,) = info.value.problems
    assert got.startswith(problem.format(tmp=tmp_path)), got


@pytest.mark.parametrize(
    ("evidence", "trial", "shared"),
    [
        ("ev", "ev", "ev/cam0"),  # both save to ev/cam0
        ("ev", "ev/cam0/trial", "ev/cam0"),
        ("ev", "ev/cam0@detect-0123abcd", "ev/cam0"),  # a folder the camera keeps for another model
        ("trial/cam1/ev", "trial", "trial/cam1/ev/cam0"),  # the camera's folder inside the trial's
        ("ev", "ev/cam1", "ev/cam1"),  # cam0's trial saves to ev/cam1/cam0, inside cam1's folder
        ("ev", "ok", None),
        ("ev", "ev/disagreements", None),  # a folder of its own, beside the cameras'
        ("trial/ev", "trial", None),  # the trial's camera folders are trial/cam0 and trial/cam1
    ],
)
def test_a_trial_evidence_folder_shared_with_a_cameras_is_refused_when_the_config_loads(
    tmp_path: Path, evidence: str, trial: str, shared: str | None
) -> None:
    (tmp_path / "m.onnx").write_bytes(b"x")
    config = tmp_path / "edged.toml"
    config.write_text(
        f'[model]\npath = "m.onnx"\n[model.candidate]\npath = "m.onnx"\nevidence_dir = "{trial}"\n'
        f'[evidence]\ndir = "{evidence}"\n'
        '[[source]]\ntype = "synthetic"\ncamera_id = "cam0"\n[[source]]\ntype = "synthetic"\ncamera_id = "cam1"\n'
    )
    if shared is None:
        assert load_config(config).model.candidate is not None
        return
    with pytest.raises(ConfigError) as info:
        load_config(config)
    (got,) = info.value.problems
    assert got.startswith(f"model.candidate.evidence_dir: {tmp_path / trial} would share camera"), got
    assert f"evidence folder {tmp_path / shared}, and two stores" in got and "a folder of its own" in got


def test_a_trial_evidence_folder_through_a_loop_of_links_is_no_crash_at_load(tmp_path: Path) -> None:
    (tmp_path / "m.onnx").write_bytes(b"x")
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    config = tmp_path / "edged.toml"
    config.write_text('[model]\npath = "m.onnx"\n[model.candidate]\npath = "m.onnx"\nevidence_dir = "a/x"\n')
    candidate = load_config(config).model.candidate  # before, resolving it raised RuntimeError: a traceback
    assert candidate is not None and candidate.evidence_dir == tmp_path / "a/x"


def test_an_evidence_folder_yet_to_be_made_or_under_a_folder_is_accepted(tmp_path: Path) -> None:
    (tmp_path / "m.onnx").write_bytes(b"x")
    config = tmp_path / "edged.toml"
    config.write_text('[model]\npath = "m.onnx"\n[evidence]\ndir = "not/yet/made"\n')
    settings = load_config(config)
    assert settings.evidence is not None and settings.evidence.dir == tmp_path / "not/yet/made"


def test_a_reload_that_changes_a_cameras_evidence_keys_keeps_its_counters(tmp_path: Path) -> None:
    repo = Path(__file__).resolve().parent.parent
    config = tmp_path / "edged.toml"

    def settings(max_per_minute: int) -> Settings:
        config.write_text(
            f'[model]\npath = "{repo / "models/demo.onnx"}"\n[source]\ntype = "synthetic"\n'
            f'[evidence]\ndir = "{tmp_path / "ev"}"\nsave = "all"\nmax_per_minute = {max_per_minute}\n'
        )
        return load_config(config)

    services = Services(lambda: None, threading.Event())
    output = EvidenceOutput.from_settings(settings(60), services)
    assert output is not None
    try:
        first = output.writers["cam0"]
        _offer_grey(first)
        assert wait_for(lambda: first.saved == 1, timeout_s=10)
        assert output.reload(settings(30), services) is output
        second = output.writers["cam0"]
        assert second is not first and second.cfg.max_per_minute == 30
        assert second.report().saved == 1  # was 0: a changed key reset the counters
    finally:
        output.close()


def two_cameras(tmp_path: Path, evidence: Path) -> Settings:
    """Cameras Line1 and line1, alike but for case, saving every frame under ``evidence``."""
    repo = Path(__file__).resolve().parent.parent
    config = tmp_path / "edged.toml"
    config.write_text(
        f'[model]\npath = "{repo / "models/demo.onnx"}"\n'
        '[[source]]\ntype = "synthetic"\ncamera_id = "Line1"\n[[source]]\ntype = "synthetic"\ncamera_id = "line1"\n'
        f'[evidence]\ndir = "{evidence}"\nsave = "all"\nmax_per_minute = 0\n'
    )
    return load_config(config)


def test_cameras_alike_but_for_case_have_folders_of_their_own_and_check_leaves_none_behind(tmp_path: Path) -> None:
    settings = two_cameras(tmp_path, tmp_path / "evidence")
    with MadeFolders() as made:
        assert EvidenceOutput.shared(settings, made) is None
    assert not (tmp_path / "evidence").exists()
    assert EvidenceOutput.shared(settings) is None  # as a start makes them, apart on a drive that tells case apart
    assert sorted(p.name for p in (tmp_path / "evidence").iterdir()) == ["Line1", "line1"]


def test_a_bind_mount_giving_two_cameras_one_folder_is_said_as_such(tmp_path: Path) -> None:
    settings = two_cameras(tmp_path, tmp_path / "evidence")
    (tmp_path / "evidence" / "Line1").mkdir(parents=True)
    (tmp_path / "evidence" / "line1").mkdir()
    if (
        os.geteuid() != 0
        or subprocess.run(["mount", "--bind", *(str(tmp_path / "evidence" / n) for n in ("Line1", "line1"))]).returncode
    ):
        pytest.skip("this process may not mount")
    try:
        problem = EvidenceOutput.shared(settings)
    finally:
        subprocess.run(["umount", str(tmp_path / "evidence" / "line1")], check=True)
    assert (
        problem is not None
        and "cameras line1 and Line1, are one folder: one is mounted on the other (a bind mount)" in problem
    ), problem
    assert problem.endswith("give one camera another camera_id")


def test_a_camera_folder_found_to_be_another_cameras_once_the_drive_is_there_is_refused_by_both_writers(
    tmp_path: Path,
) -> None:
    evidence = tmp_path / "drive" / "evidence"  # on a drive not mounted yet: no folder to compare at start
    settings = two_cameras(tmp_path, evidence)
    assert EvidenceOutput.shared(settings) is None
    output = EvidenceOutput(settings)
    try:
        writers = list(output.writers.values())
        assert wait_for(lambda: all(w.failures.count == 1 for w in writers), timeout_s=10)  # the folder is missing
        (evidence / "Line1").mkdir(parents=True)  # the drive comes, line1's folder a link to Line1's
        (evidence / "line1").symlink_to("Line1")
        for writer in writers:
            _offer_grey(writer)
        assert wait_for(lambda: all(w.failures.count == 2 for w in writers), timeout_s=10)
        for writer, other in zip(writers, ("line1", "Line1"), strict=True):
            assert f"cameras {writer.camera_id} and {other}, are one folder: {evidence}/line1 is a link to" in (
                writer.failures.last or ""
            )
            assert writer.saved == 0
    finally:
        output.close()
    assert list((evidence / "Line1").iterdir()) == []


def test_the_folder_is_tried_with_a_file_created_and_removed_leaving_nothing_behind(tmp_path: Path) -> None:
    assert folder_problem(tmp_path / "evidence", "cam0") is None
    assert list(tmp_path.iterdir()) == []  # the folders it made are gone again
    (tmp_path / "kept" / "cam0").mkdir(parents=True)
    assert folder_problem(tmp_path / "kept", "cam0") is None
    assert list((tmp_path / "kept").rglob("*")) == [tmp_path / "kept" / "cam0"]  # what was there stays


def test_a_folder_that_takes_no_file_is_named_with_the_reason(tmp_path: Path) -> None:
    problem = folder_problem(Path("/proc/edged-evidence"), "cam0")
    assert problem == "/proc/edged-evidence cannot be made in /proc: that filesystem takes no files"
    missing = folder_problem(tmp_path / "unmounted" / "evidence", "cam0")
    assert missing is not None and "its parent must exist: a drive not mounted?" in missing
    with read_only_folder(tmp_path / "ro"):
        problem = folder_problem(tmp_path / "ro" / "evidence", "cam0")
    assert problem is not None and ("read-only" in problem or "permission denied" in problem), problem


def test_a_clock_stepped_forward_past_the_age_limit_while_saving_deletes_no_frame_early(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A board without a real-time clock saves evidence on a clock 200 days behind, then NTP sets it
    right while edged runs. The images saved before carry the old clock's times (made so here with
    `os.utime`, as the kernel stamped them), 200 days past the age limit: the writer moves them on by
    the step it sees, so none goes, then or after a restart (before: the next save deleted them all)."""
    real = time.time
    behind_s = 200 * 86400.0
    monkeypatch.setattr(time, "time", lambda: real() - behind_s)  # the wall clock as the board booted
    w = writer(tmp_path, save="all", max_per_minute=0, max_age_days=30)
    w.start()
    try:
        for i in range(3):
            w.submit(frame(i, t_ns=time.time_ns() - round(behind_s * 1e9)))
        assert wait_for(lambda: w.saved == 3, 10)
        for image in tmp_path.rglob("*.jpg"):
            stamp = image.stat().st_mtime - behind_s
            os.utime(image, (stamp, stamp))
        monkeypatch.setattr(time, "time", real)  # NTP steps the clock 200 days forward
        w.submit(frame(3))
        assert wait_for(lambda: w.saved == 4, 10)
        assert len(saved_sets(tmp_path)) == 4
    finally:
        w.stop(timeout_s=10)
    reopened = EvidenceStore(tmp_path / "ev", "cam0", 10**9, 30)
    reopened.open()  # the next start: each image's time is when it was saved, on the clock as set right
    assert len(saved_sets(tmp_path)) == 4 and w.report().errors == 0


def test_a_clock_stepped_forward_while_edged_was_stopped_deletes_no_frame_at_the_next_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A board without a real-time clock saves evidence on a clock 200 days behind; edged stops, NTP
    sets the clock right, and edged starts again in the same boot. The images carry the old clock's
    times (`os.utime`, as the kernel stamped them), 200 days past the age limit: the camera folder
    says which boot and clock they were stamped on, so the start moves them on by the step, and
    they are aged from when they were saved (before: the start deleted them all)."""
    real = time.time
    behind_s = 200 * 86400.0
    monkeypatch.setattr(time, "time", lambda: real() - behind_s)  # the wall clock as the board booted
    store = EvidenceStore(tmp_path, "cam0", 10**9, 30)
    store.open()
    for i in range(3):
        store.save(frame(i, t_ns=time.time_ns() - round(behind_s * 1e9)), 95)
    for image in tmp_path.rglob("*.jpg"):
        stamp = image.stat().st_mtime - behind_s
        os.utime(image, (stamp, stamp))
    monkeypatch.setattr(time, "time", real)  # edged stopped; NTP steps the clock 200 days forward
    restarted = EvidenceStore(tmp_path, "cam0", 10**9, 30)
    restarted.open()
    assert len(saved_sets(tmp_path)) == 3
    assert restarted.total_bytes == sum(p.stat().st_size for p in files_on_disk(tmp_path))
    now = real()
    assert restarted.prune(now + 29 * 86400) == 0
    assert restarted.prune(now + 31 * 86400) == 3


def test_a_clock_record_that_holds_no_time_is_written_again_and_a_later_step_is_followed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The camera folder's clock record of this boot says NaN (Python's JSON reader takes it). Before,
    it was taken as the clock the images were stamped on: every step compared with it came out NaN,
    so NTP setting the clock 200 days forward while edged ran was not followed, and the frames saved
    before it were deleted as 200 days old."""
    (tmp_path / "cam0").mkdir()
    record = tmp_path / "cam0" / CLOCK_RECORD
    record.write_text(json.dumps({"boot_id": boot_id(), "wall_less_boot_s": float("nan")}))
    real = time.time
    behind_s = 200 * 86400.0
    monkeypatch.setattr(time, "time", lambda: real() - behind_s)  # the wall clock as the board booted
    store = EvidenceStore(tmp_path, "cam0", 10**9, 30)
    store.open()
    assert json.loads(record.read_text())["wall_less_boot_s"] == pytest.approx(store.clock_s)  # a time again
    for i in range(3):
        store.save(frame(i, t_ns=time.time_ns() - round(behind_s * 1e9)), 95)
    for image in tmp_path.rglob("*.jpg"):  # the kernel stamps them on the clock the board runs on
        stamp = image.stat().st_mtime - behind_s
        os.utime(image, (stamp, stamp))
    monkeypatch.setattr(time, "time", real)  # NTP steps the clock 200 days forward
    store.follow_clock()
    now = real()
    assert store.prune(now + 29 * 86400) == 0
    assert store.prune(now + 31 * 86400) == 3


def test_a_clock_record_made_a_folder_is_said_once_and_every_frame_is_still_saved(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Before, writing the record failed at every save, so every save failed (counted and logged)."""
    (tmp_path / "cam0" / CLOCK_RECORD).mkdir(parents=True)
    store = EvidenceStore(tmp_path, "cam0", 10**9, 30)
    with caplog.at_level(logging.WARNING, logger="edged.evidence"):
        store.open()
        for i in range(3):
            store.follow_clock()
            store.save(frame(i), 95)
    assert len(saved_sets(tmp_path)) == 3 and (tmp_path / "cam0" / CLOCK_RECORD).is_dir()
    [said] = [r.getMessage() for r in caplog.records if CLOCK_RECORD in r.getMessage()]
    assert "is a folder" in said and "remove the folder" in said
    assert store.total_bytes == sum(p.stat().st_size for p in files_on_disk(tmp_path))


def _saved_in_1970(root: Path, monkeypatch: pytest.MonkeyPatch, count: int) -> None:
    """``count`` frames saved by a store on a clock at 1970-01-02, an hour after a boot that had no
    time to set it by, their images' times that clock's; the clock then set right."""
    real, booted_s = time.time, 86400.0 + 3600
    monkeypatch.setattr(time, "time", lambda: booted_s)
    store = EvidenceStore(root, "cam0", 10**9, 30)
    store.open()
    for i in range(count):
        store.save(frame(i, t_ns=round(booted_s * 1e9), noise=True), 95)
    for image in root.rglob("*.jpg"):
        os.utime(image, (booted_s, booted_s))
    monkeypatch.setattr(time, "time", real)


def test_frames_saved_on_a_clock_not_yet_set_are_aged_from_when_they_were_saved_once_it_is_set(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """This boot began in 1970 (no real-time clock, no time saved); edged saved two frames, stopped,
    and NTP set the clock before it started again. The step sets their times right, and though
    their day folder is 1970's, the age limit deletes them 30 days after they were saved, not
    before (before: the start deleted them, as 56 years old); their emptied day folder goes too."""
    real = time.time
    _saved_in_1970(tmp_path, monkeypatch, 2)
    restarted = EvidenceStore(tmp_path, "cam0", 10**9, 30)
    restarted.open()
    assert len(saved_sets(tmp_path)) == 2
    now = real()
    assert restarted.prune(now + 29 * 86400) == 0
    assert restarted.prune(now + 31 * 86400) == 2
    assert saved_sets(tmp_path) == [] and not (tmp_path / "cam0" / "1970-01-02").exists()
    assert restarted.total_bytes == sum(p.stat().st_size for p in files_on_disk(tmp_path))


def test_frames_an_earlier_boot_saved_on_a_clock_not_yet_set_keep_an_unknown_age_and_go_last_for_room(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A board that boots to 1970 saved three frames, then lost power before NTP set its clock. In
    the next boot, on a clock NTP has set, when they were saved cannot be known: no age limit
    deletes them (before: the start deleted them all, as 56 years old), and for room they go
    after every frame of a known day, so the quota keeps them longest; it still bounds them."""
    real = time.time
    monkeypatch.setattr("edged.evidence.boot_id", lambda: "an-earlier-boot")
    _saved_in_1970(tmp_path, monkeypatch, 3)
    monkeypatch.setattr("edged.evidence.boot_id", boot_id)  # this boot
    restarted = EvidenceStore(tmp_path, "cam0", 10**9, 30)
    restarted.open()
    unknown = saved_sets(tmp_path)
    assert len(unknown) == 3
    today = [frame(i, t_ns=time.time_ns(), noise=True) for i in (3, 4)]
    for saved in today:
        restarted.save(saved, 95)
    restarted.max_bytes = restarted.total_bytes - 1  # room for all but one
    assert restarted.prune(real()) == 1
    assert saved_sets(tmp_path) == sorted([*unknown, day_and_stem("cam0", today[1].capture_time_ns, 4)[1]])
    assert restarted.prune(real() + 3650 * 86400) == 1  # ten years on: today's frame goes, those of 1970 stay
    assert saved_sets(tmp_path) == unknown
    restarted.max_bytes = 1
    assert restarted.prune(real()) == 3 and saved_sets(tmp_path) == []


def test_the_check_tries_evidence_in_a_state_directory_systemd_has_still_to_make(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before the service's first start its state directory is not there: systemd makes it as it starts.
    The check said the default evidence folder's parent was missing ("a drive not mounted?")."""
    state = tmp_path / "state"
    monkeypatch.setenv("STATE_DIRECTORY", str(state))
    assert folder_problem(state / "evidence", "cam0") is None
    assert not state.exists()  # made for the try, removed after
    unmounted = folder_problem(tmp_path / "drive" / "evidence", "cam0")  # any other missing parent: as before
    assert unmounted is not None and "missing" in unmounted


def test_a_link_between_two_cameras_folders_is_named_as_such_under_a_linked_evidence_dir(tmp_path: Path) -> None:
    """Under an evidence.dir that is itself a link (to a drive's folder), the camera folder that is the
    link is named, not the other: the message told the user to remove the folder holding the frames."""
    (tmp_path / "drive" / "line1").mkdir(parents=True)
    (tmp_path / "drive" / "Line1").symlink_to("line1")
    (tmp_path / "evidence").symlink_to("drive")
    problem = EvidenceOutput.shared(two_cameras(tmp_path, tmp_path / "evidence"))
    evidence = tmp_path / "evidence"
    assert problem is not None and f"{evidence}/Line1 is a link to {evidence}/line1" in problem, problem
    assert problem.endswith(f"or remove the link {evidence}/Line1"), problem
    (tmp_path / "drive" / "Line1").unlink()  # both folders links to a third
    (tmp_path / "drive" / "line1").rename(tmp_path / "drive" / "elsewhere")
    for name in ("Line1", "line1"):
        (tmp_path / "drive" / name).symlink_to("elsewhere")
    problem = EvidenceOutput.shared(two_cameras(tmp_path, tmp_path / "evidence"))
    assert problem is not None and f"both are links to {tmp_path}/drive/elsewhere" in problem, problem
    assert problem.endswith("or remove one of the links"), problem
