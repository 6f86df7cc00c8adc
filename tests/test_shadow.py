"""The shadow trial in process: boxes paired by class, the candidate run only in time to spare,
the tally and the gate, promotion and rollback handing back the right model, and the loop time the
trial took from the live frames."""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import pytest
from onnx_models import fixed_scene, reversed_classes

from edged.config import CandidateConfig, ModelConfig, Settings
from edged.decode import Detections
from edged.messages import StageLatency
from edged.model import load_model
from edged.pipeline import Processed, frame_path
from edged.settings.inspect import InspectConfig
from edged.settings.sources import SyntheticSourceConfig
from edged.shadow import BUSY_KEPT, BusyTimes, Shadow, Swap, match
from edged.sources.base import Frame

TASKS = Path(__file__).parent / "data" / "tasks"
ANOMALY = Path(__file__).parent / "data" / "anomaly"
SCENE = [(16.0, 20.0, 8.0, 8.0, 0, 0.9), (48.0, 20.0, 8.0, 8.0, 1, 0.8), (16.0, 44.0, 8.0, 8.0, 2, 0.7)]


def detections(*rows: tuple[float, float, float, float, int, float]) -> Detections:
    data = np.array(rows, np.float64).reshape(-1, 6)
    return Detections(data[:, :4].astype(np.float32), data[:, 5].astype(np.float32), data[:, 4].astype(np.int32))


def test_boxes_pair_by_class_at_iou_one_half_and_the_rest_count_on_their_side() -> None:
    live = detections((0, 0, 10, 10, 0, 0.9), (20, 20, 30, 30, 0, 0.8), (0, 0, 10, 10, 1, 0.7))
    candidate = detections((1, 1, 11, 11, 0, 0.6), (50, 50, 60, 60, 0, 0.5), (0, 0, 10, 10, 2, 0.7))
    found = match(live, candidate)
    assert found.matched == {0: 1, 1: 0, 2: 0}
    assert found.live_only == {0: 1, 1: 1, 2: 0} and found.candidate_only == {0: 1, 1: 0, 2: 1}
    assert round(found.shift_sum, 4) == -0.3 and not found.agree
    assert match(live, live).agree


def settings(tmp_path: Path, candidate: list[Any], **gate: Any) -> Settings:
    fixed_scene(tmp_path / "live.onnx", SCENE)
    fixed_scene(tmp_path / "candidate.onnx", candidate)
    trial = CandidateConfig(
        path=tmp_path / "candidate.onnx", sample_every=1, control=f"ipc://{tmp_path}/c.sock", **{"min_frames": 3, **gate}
    )
    source = SyntheticSourceConfig(width=128, height=96)
    return Settings(model=ModelConfig(path=tmp_path / "live.onnx", candidate=trial), source=(source,))


def live_frames(s: Settings, count: int, captured_ns: list[int] | None = None) -> list[Processed]:
    """Frames through the live model, captured at ``captured_ns`` (else 50 ms apart from now)."""
    model = load_model(s.model, s.runtime)
    path = frame_path(s, model, s.source[0])
    image = np.full((96, 128, 3), 90, np.uint8)
    now = time.monotonic_ns()
    done = []
    for i in range(count):
        t_capture_ns = captured_ns[i] if captured_ns is not None else now + i * 50_000_000
        outcome = path.run(Frame(image, i, t_capture_ns, time.time_ns(), "bgr"))
        assert isinstance(outcome, Processed)
        done.append(outcome)
    return done


class Clock:
    """A monotonic clock the test sets: each read returns ``ns``, then moves it on by ``step``."""

    def __init__(self, ns: int = 0, step: int = 0) -> None:
        self.ns, self.step = ns, step

    def __call__(self) -> int:
        now = self.ns
        self.ns += self.step
        return now


MS = 1_000_000


def test_without_time_to_spare_the_candidate_never_runs_and_says_how_many_samples_it_skipped(tmp_path: Path) -> None:
    s = settings(tmp_path, SCENE)
    shadow = Shadow(s, s.model.candidate, load_model(s.model, s.runtime))  # type: ignore[arg-type]
    for done in live_frames(s, 4):
        shadow.observe("cam0", done)
        assert not shadow.run(0.0)
    report = shadow.report()
    assert report.frames == 0 and report.skipped_busy == 3 and report.latency is None
    assert report.gate == "compared on 0 frame(s) of the 3 the gate asks for"


def test_with_time_to_spare_an_identical_candidate_agrees_and_passes_the_gate(tmp_path: Path) -> None:
    s = settings(tmp_path, SCENE)
    shadow = Shadow(s, s.model.candidate, load_model(s.model, s.runtime))  # type: ignore[arg-type]
    for done in live_frames(s, 3):
        shadow.observe("cam0", done)
        assert shadow.run(10.0)
    report = shadow.report()
    assert report.frames == 3 and report.agreement == 1.0 and report.gate is None and report.skipped_busy == 0
    assert report.verdicts == {"none/none": 3} and report.classes["dust"].matched == 3


def test_the_gate_names_a_class_the_candidate_misses(tmp_path: Path) -> None:
    s = settings(tmp_path, SCENE[:2], min_agreement=0.0)
    shadow = Shadow(s, s.model.candidate, load_model(s.model, s.runtime))  # type: ignore[arg-type]
    for done in live_frames(s, 3):
        shadow.observe("cam0", done)
        shadow.run(10.0)
    assert shadow.report().gate == "the candidate misses 100.0% of the live model's dust boxes, above 2.0%"


def test_promotion_keeps_the_live_model_and_rollback_hands_it_back_with_the_trial_started_again(tmp_path: Path) -> None:
    s = settings(tmp_path, SCENE[:2])
    shadow = Shadow(s, s.model.candidate, load_model(s.model, s.runtime))  # type: ignore[arg-type]
    live = load_model(s.model, s.runtime)
    paths = {"cam0": frame_path(s, live, s.source[0])}
    promoted = shadow.promote(Swap(live, paths))
    assert promoted.model is shadow.model and promoted.paths == shadow.paths
    assert shadow.state == "live" and shadow.previous is live and shadow.report().model == live.info
    back = shadow.rollback()
    assert back is not None and back.model is live and back.paths == paths
    assert shadow.state == "on_trial" and shadow.previous is None and shadow.rollback() is None


def test_a_candidate_that_does_not_load_is_reported_failed(tmp_path: Path) -> None:
    s = settings(tmp_path, SCENE)
    (tmp_path / "candidate.onnx").write_bytes(b"no model")
    shadow = Shadow(s, s.model.candidate, load_model(s.model, s.runtime))  # type: ignore[arg-type]
    report = shadow.report()
    assert report.state == "failed" and report.model is None and "did not load" in (report.error or "")
    assert not shadow.run(10.0)


def test_a_candidate_of_another_task_is_refused_naming_both_tasks(tmp_path: Path) -> None:
    s = settings(tmp_path, SCENE)
    shutil.copy(TASKS / "cls.onnx", tmp_path / "candidate.onnx")
    report = Shadow(s, s.model.candidate, load_model(s.model, s.runtime)).report()  # type: ignore[arg-type]
    assert report.state == "failed" and report.model is None and report.frames == 0
    assert "the candidate is a classify model and the live model a detect model" in (report.error or "")


def test_a_candidate_whose_class_ids_name_other_classes_is_refused_naming_the_first(tmp_path: Path) -> None:
    s = settings(tmp_path, SCENE)
    (tmp_path / "candidate.labels").write_text("crack\nscratch\ndust\n")
    assert s.model.candidate is not None
    trial = s.model.candidate.model_copy(update={"labels": tmp_path / "candidate.labels"})
    report = Shadow(s, trial, load_model(s.model, s.runtime)).report()
    assert report.state == "failed"
    assert "the candidate's class 0 is 'crack' where the live model's is 'scratch'" in (report.error or "")


def anomaly_trial(tmp_path: Path, inspect: InspectConfig | None) -> Shadow:
    """A trial of PaDiM at the threshold 0.31 beside PaDiM at 0.7, which has run on spot_320x240
    (score 0.677): OK, or normal, under the live model's threshold, NG, or anomalous, under the
    candidate's own."""
    shutil.copy(ANOMALY / "padim.onnx", tmp_path / "live.onnx")
    shutil.copy(ANOMALY / "padim.onnx", tmp_path / "candidate.onnx")
    trial = CandidateConfig(
        path=tmp_path / "candidate.onnx", anomaly_threshold=0.31, sample_every=1, control=f"ipc://{tmp_path}/c.sock"
    )
    s = Settings(
        model=ModelConfig(path=tmp_path / "live.onnx", anomaly_threshold=0.7, candidate=trial),
        source=(SyntheticSourceConfig(width=320, height=240),),
        inspect=inspect,
    )
    return one_trial(s, trial, ANOMALY / "spot_320x240.png")[0]


def one_trial(s: Settings, trial: CandidateConfig, image: Path) -> tuple[Shadow, Processed]:
    """The trial of ``trial`` after it has run on the live model's frame of ``image``, and that frame."""
    live = load_model(s.model, s.runtime)
    frame = Frame(cv2.imread(str(image)), 0, time.monotonic_ns(), time.time_ns(), "bgr")
    done = frame_path(s, live, s.source[0]).run(frame)
    assert isinstance(done, Processed)
    shadow = Shadow(s, trial, live)
    shadow.observe("cam0", done)
    assert shadow.run(10.0)
    return shadow, done


def _reversed_trial(tmp_path: Path) -> CandidateConfig:
    """A trial of the classifier with its classes reversed, sampling every frame, saving its disagreements."""
    return CandidateConfig(
        path=reversed_classes(tmp_path / "candidate.onnx"),
        sample_every=1,
        control=f"ipc://{tmp_path}/c.sock",
        evidence_dir=tmp_path / "disagreements",
    )


def test_a_classifiers_disagreement_is_filed_under_the_live_models_class(tmp_path: Path) -> None:
    # As a detector's is labelled with the live model's boxes; it was filed under the candidate's class.
    trial = _reversed_trial(tmp_path)
    s = Settings(
        model=ModelConfig(path=TASKS / "cls.onnx", candidate=trial), source=(SyntheticSourceConfig(width=320, height=240),)
    )
    shadow, done = one_trial(s, trial, TASKS / "wide.png")
    shadow.close()
    report = shadow.report()
    assert report.agreement == 0.0 and report.disagreements_saved == 1, report
    names = done.plan.model.class_names
    live_class, candidate_class = (names[c] for c in (done.result.top[0], 4 - done.result.top[0]))  # type: ignore[union-attr]
    assert live_class != candidate_class
    saved = [p for p in (tmp_path / "disagreements").rglob("*") if p.suffix in (".jpg", ".png")]
    assert [p.parent.name for p in saved] == [live_class], saved


def test_two_cameras_whose_disagreement_folders_are_one_save_none_there(tmp_path: Path) -> None:
    # On a FAT trial drive ids alike but for case name one folder, as a link does here: each camera's
    # disagreements went there, and each writer's retention deleted the other's as its own.
    trial = _reversed_trial(tmp_path)
    cameras = tuple(SyntheticSourceConfig(camera_id=c, width=320, height=240) for c in ("Line1", "line1"))
    s = Settings(model=ModelConfig(path=TASKS / "cls.onnx", candidate=trial), source=cameras)
    (tmp_path / "disagreements" / "Line1").mkdir(parents=True)
    (tmp_path / "disagreements" / "line1").symlink_to("Line1")
    live = load_model(s.model, s.runtime)
    shadow = Shadow(s, trial, live)
    for cfg in s.source:
        frame = Frame(cv2.imread(str(TASKS / "wide.png")), 0, time.monotonic_ns(), time.time_ns(), "bgr")
        done = frame_path(s, live, cfg).run(frame)
        assert isinstance(done, Processed)
        shadow.observe(cfg.camera_id, done)
        assert shadow.run(10.0)
    shadow.close()
    assert shadow.report().disagreements_saved == 0
    assert not [p for p in (tmp_path / "disagreements" / "Line1").rglob("*") if p.suffix in (".jpg", ".png")]


def test_a_disagreement_is_saved_in_the_dataset_of_the_live_model_whose_boxes_label_it(tmp_path: Path) -> None:
    # A segmentation candidate beside a detector: the label is the live model's boxes, by its class ids,
    # so the folder is a detection dataset of its names, not a segmentation dataset of the candidate's.
    s = settings(tmp_path, SCENE)
    shutil.copy(TASKS / "seg.onnx", tmp_path / "candidate.onnx")
    (tmp_path / "candidate.labels").write_text("scratch\ncrack\ndust\n")
    assert s.model.candidate is not None
    trial = s.model.candidate.model_copy(
        update={"labels": tmp_path / "candidate.labels", "evidence_dir": tmp_path / "disagreements"}
    )
    s = s.model_copy(update={"model": s.model.model_copy(update={"candidate": trial})})
    shadow, done = one_trial(s, trial, TASKS / "wide.png")
    shadow.close()
    assert shadow.report().disagreements_saved == 1
    folder = tmp_path / "disagreements" / "cam0"
    record = json.loads((folder / "dataset.json").read_text())
    assert record == {"task": "detect", "names": list(done.plan.model.class_names)}
    (label,) = folder.rglob("labels/*.txt")
    assert len(label.read_text().splitlines()) == len(SCENE)


def test_an_anomaly_candidate_is_judged_by_its_own_threshold(tmp_path: Path) -> None:
    assert anomaly_trial(tmp_path, InspectConfig()).report().verdicts == {"ok/ng": 1}


def test_without_inspect_an_anomaly_candidate_is_compared_by_its_judgement_not_by_boxes_it_has_none_of(
    tmp_path: Path,
) -> None:
    report = anomaly_trial(tmp_path, None).report()
    assert report.verdicts == {"normal/anomalous": 1} and report.agreement == 0.0


@pytest.mark.unit
def test_busy_times_charge_a_frame_the_busy_time_after_its_capture_and_stay_bounded() -> None:
    busy = BusyTimes()
    busy.add(20 * MS, 50 * MS)
    busy.add(60 * MS, 70 * MS)
    busy.add(80 * MS, 80 * MS)  # took no time: nothing to charge
    assert len(busy) == 2
    assert busy.delay_ns(10 * MS) == 40 * MS  # waited through both
    assert busy.delay_ns(40 * MS) == 20 * MS  # the first run's last 10 ms, then the second
    assert busy.delay_ns(75 * MS) == 0
    busy.settle(55 * MS)  # every camera has a frame captured at 55 ms or later: the first is done
    assert len(busy) == 1 and busy.delay_ns(0) == 10 * MS
    for i in range(10 * BUSY_KEPT):
        busy.add(100 * MS + 2 * i, 100 * MS + 2 * i + 1)
    assert len(busy) == BUSY_KEPT  # never settled (a camera gone quiet): the oldest go
    assert busy.delay_ns(0) == BUSY_KEPT


def test_a_frame_that_waited_through_a_candidate_run_is_charged_the_run_and_one_after_it_nothing(
    tmp_path: Path,
) -> None:
    s = settings(tmp_path, SCENE)
    clock = Clock(10 * MS)
    shadow = Shadow(s, s.model.candidate, load_model(s.model, s.runtime), clock=clock)  # type: ignore[arg-type]
    first, before, during, after = live_frames(s, 4, [0, 10 * MS, 40 * MS, 60 * MS])
    shadow.observe("cam0", first)
    clock.ns, clock.step = 20 * MS, 15 * MS  # the candidate runs from 20 to 35 ms, and is compared until 50 ms
    assert shadow.run(10.0)
    clock.ns, clock.step = 80 * MS, 0
    for done in (before, during, after):
        shadow.observe("cam0", done)
    report = shadow.report()
    assert report.live_frames == 4 and report.live_delayed == 2  # the trial's 30 ms, its last 10 ms
    assert report.live_delay_ms == 10.0  # 40 ms over 4 frames
    assert report.live_delay == StageLatency(p50_ms=20.0, p99_ms=29.8)


def test_the_sample_copy_is_charged_to_the_frames_captured_before_it_ended(tmp_path: Path) -> None:
    s = settings(tmp_path, SCENE)
    clock = Clock(10 * MS, 5 * MS)  # the copy of the first frame takes 10 to 15 ms
    shadow = Shadow(s, s.model.candidate, load_model(s.model, s.runtime), clock=clock)  # type: ignore[arg-type]
    first, second = live_frames(s, 2, [0, 12 * MS])
    shadow.observe("cam0", first)
    shadow.observe("cam0", second)
    report = shadow.report()
    assert (report.live_frames, report.live_delayed, report.live_delay_ms) == (2, 1, 1.5)
    assert report.live_delay == StageLatency(p50_ms=3.0, p99_ms=3.0)


def test_the_busy_times_kept_stay_few_over_many_frames(tmp_path: Path) -> None:
    s = settings(tmp_path, SCENE)
    clock = Clock(0, MS)
    shadow = Shadow(s, s.model.candidate, load_model(s.model, s.runtime), clock=clock)  # type: ignore[arg-type]
    done = live_frames(s, 1)[0]
    for i in range(2000):
        captured = clock.ns
        shadow.observe("cam0", replace(done, frame=replace(done.frame, frame_id=i, t_capture_ns=captured)))
        shadow.run(10.0)
        assert len(shadow.busy) <= 3
    assert shadow.report().live_frames == 2000


def test_before_any_live_frame_the_report_says_no_delay(tmp_path: Path) -> None:
    s = settings(tmp_path, SCENE)
    report = Shadow(s, s.model.candidate, load_model(s.model, s.runtime)).report()  # type: ignore[arg-type]
    assert (report.live_frames, report.live_delayed, report.live_delay_ms, report.live_delay) == (0, 0, None, None)


def test_a_candidate_leaves_the_live_models_optimised_model_cache_to_it(tmp_path: Path) -> None:
    # Both models were given runtime.optimized_model_path: each found the other's graph there and wrote
    # its own, so every start optimised both, wrote the cache twice and never started the live one from it.
    s = settings(tmp_path, SCENE[:2])
    s = s.model_copy(update={"runtime": s.runtime.model_copy(update={"optimized_model_path": tmp_path / "opt.onnx"})})
    live = load_model(s.model, s.runtime)
    stamp = tmp_path / "opt.onnx.json"
    written = (stamp.read_bytes(), (tmp_path / "opt.onnx").read_bytes())
    shadow = Shadow(s, s.model.candidate, live)  # type: ignore[arg-type]
    assert shadow.model is not None and shadow.state != "failed"
    assert (stamp.read_bytes(), (tmp_path / "opt.onnx").read_bytes()) == written
    assert sorted(p.name for p in tmp_path.glob("opt*")) == ["opt.onnx", "opt.onnx.json"]
