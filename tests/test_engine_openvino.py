"""The OpenVINO engine: the same boxes as ONNX Runtime at f32, bf16 close, INT8 models, refusals, no allocation."""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import tracemalloc
from pathlib import Path

import cv2
import numpy as np
import pytest
from allocations import NumpyAllocations
from daemon import RunningDaemon, free_port, run_cli, served_and_stopped, write_config
from filesystems import fill, tmpfs
from onnx_models import PROBE_BOX, colour_probe, damage_on_disk, dynamic_probe, probe_box, solid_frame

from edged.anomaly import Anomaly
from edged.config import ModelConfig, RuntimeConfig
from edged.decode import Detections
from edged.errors import EXIT_CONFIG, ConfigError, ContractError
from edged.messages import DetectionsMessage
from edged.model import LoadedModel, load_model
from edged.pipeline import FramePath, FramePipeline, Processed
from edged.settings.inspect import InspectConfig
from edged.signature import sign, signature_path
from edged.sources.base import Frame
from edged.sources.scenes import SceneGenerator
from edged.verdict import Inspector

ov = pytest.importorskip("openvino", reason="the openvino package (edged[openvino]) is not installed")

DEMO = Path(__file__).resolve().parent.parent / "models" / "demo.onnx"
ANOMALY = Path(__file__).resolve().parent / "data" / "anomaly"
SCENES = 4  # 1280x720 scenes with defects: several boxes of every class


def _scenes() -> list[np.ndarray]:
    generator = SceneGenerator(1280, 720, seed=0)
    return [generator.render(i).image for i in range(SCENES)]


def _load(path: Path, engine: str, precision: str = "f32", **runtime: object) -> LoadedModel:
    return load_model(ModelConfig(path=path, engine=engine, precision=precision), RuntimeConfig(**runtime))  # type: ignore[arg-type]


def _detect(model: LoadedModel, images: list[np.ndarray]) -> list[Detections]:
    """Each image through the real pipeline, its detections copied (a plan's result holds until its next frame)."""
    plan = FramePipeline(model, 1280, 720, "bgr")
    found = []
    for image in images:
        d, _ = plan.process(image)
        found.append(Detections(d.xyxy.copy(), d.scores.copy(), d.class_ids.copy()))
    return found


def _capabilities() -> list[str]:
    return list(ov.Core().get_property("CPU", "OPTIMIZATION_CAPABILITIES"))


def test_f32_gives_onnxruntimes_boxes_through_the_pipeline() -> None:
    images = _scenes()
    reference = _detect(_load(DEMO, "onnxruntime"), images)
    openvino = _load(DEMO, "openvino")
    assert openvino.engine.precision == "f32" and openvino.info.provider == "OpenVINO CPU"
    found = _detect(openvino, images)
    assert sum(len(d.scores) for d in reference) >= SCENES
    for ours, theirs in zip(found, reference, strict=True):
        assert ours.class_ids.tolist() == theirs.class_ids.tolist()
        np.testing.assert_allclose(ours.xyxy, theirs.xyxy, atol=0.01)  # float rounding, hundredths of a pixel
        np.testing.assert_allclose(ours.scores, theirs.scores, atol=1e-4)


@pytest.mark.parametrize("kind", ["padim", "patchcore"])
def test_an_anomalib_export_gives_onnxruntimes_score_map_and_regions_at_f32(kind: str) -> None:
    """Its outputs keep anomalib's names (compiling merges others onto them), so it is recognised,
    pinned to its trained size and decoded as on ONNX Runtime."""
    path = ANOMALY / f"{kind}.onnx"
    models = [_load(path, engine) for engine in ("onnxruntime", "openvino")]
    assert [o.name for o in models[1].engine.output_meta] == ["pred_score", "pred_label", "anomaly_map", "pred_mask"]
    assert models[1].task == "anomaly" and models[1].contract.shape == (1, 3, 256, 256)
    for name in ("good_1280x720", "scratch_640x480", "spot_320x240"):
        image = cv2.imread(str(ANOMALY / f"{name}.png"))
        found = []
        for model in models:
            result, _ = FramePipeline(model, image.shape[1], image.shape[0], "bgr").process(image)
            assert isinstance(result, Anomaly) and result.anomaly_map is not None
            found.append((result.score, result.anomalous, result.xyxy.copy(), result.anomaly_map.copy()))
        (score, anomalous, boxes, heat), (ov_score, ov_anomalous, ov_boxes, ov_heat) = found
        assert ov_score == pytest.approx(score, abs=1e-4) and ov_anomalous == anomalous
        np.testing.assert_array_equal(ov_boxes, boxes)
        np.testing.assert_allclose(ov_heat, heat, atol=1e-4)


def test_f32_is_asked_for_explicitly_and_the_nodes_run_in_it() -> None:
    """OpenVINO's CPU default is bf16 where the CPU has it: f32 must be set, not assumed."""
    engine = _load(DEMO, "openvino").engine
    assert engine.compiled.get_property("INFERENCE_PRECISION_HINT").to_string() == "f32"  # type: ignore[attr-defined]
    assert "bf16" not in engine.runtime_precisions() and engine.runtime_precisions()["f32"] > 0  # type: ignore[attr-defined]


@pytest.mark.skipif("BF16" not in _capabilities(), reason="this CPU has no bf16")
def test_bf16_runs_in_bf16_and_its_boxes_stay_within_two_pixels_of_f32() -> None:
    """bf16 keeps 8 bits of mantissa: scores move by about 0.01 and boxes by under a pixel on the demo;
    the bound is 2 px and 0.03, for the detections clear of the threshold (one at 0.25 may flip)."""
    images = _scenes()
    reference = _detect(_load(DEMO, "onnxruntime"), images)
    model = _load(DEMO, "openvino", "bf16")
    assert model.engine.runtime_precisions()["bf16"] > 0  # type: ignore[attr-defined]
    for ours, theirs in zip(_detect(model, images), reference, strict=True):
        for box, score, class_id in zip(theirs.xyxy, theirs.scores, theirs.class_ids, strict=True):
            if score < 0.3:
                continue
            same = ours.class_ids == class_id
            nearest = np.abs(ours.xyxy[same] - box).max(axis=1)
            assert len(nearest) and nearest.min() <= 2.0, (box, ours.xyxy[same])
            assert abs(ours.scores[same][nearest.argmin()] - score) <= 0.03


def test_an_int8_model_from_edged_quantize_runs_in_int8_with_onnxruntimes_boxes(tmp_path: Path) -> None:
    pytest.importorskip("onnx", reason="edged quantize needs onnx")
    from edged.tools import quantize as q
    from edged.tools.evaluate import scene_samples

    fp32 = _load(DEMO, "onnxruntime")
    total, frames = scene_samples(8, 1, 640, 360)
    int8 = tmp_path / "demo.int8.onnx"
    q.quantize(DEMO, int8, q.CalibrationFrames(fp32.contract, frames, total))
    images = _scenes()
    reference = _detect(_load(int8, "onnxruntime", "int8"), images)
    model = _load(int8, "openvino", "int8")
    precisions = model.engine.runtime_precisions()  # type: ignore[attr-defined]
    assert precisions["i8"] + precisions["u8"] > 0, precisions
    found = _detect(model, images)
    assert sum(len(d.scores) for d in found) >= SCENES
    for ours, theirs in zip(found, reference, strict=True):
        for box, score, class_id in zip(theirs.xyxy, theirs.scores, theirs.class_ids, strict=True):
            if score < 0.35:
                continue
            same = ours.class_ids == class_id
            nearest = np.abs(ours.xyxy[same] - box).max(axis=1)
            assert len(nearest) and nearest.min() <= 4.0, (box, ours.xyxy[same])


@pytest.mark.parametrize("engine", ["onnxruntime", "openvino"])
def test_int8_on_a_float_model_is_refused(engine: str) -> None:
    with pytest.raises(ContractError, match=r"is not quantised.*edged quantize") as info:
        _load(DEMO, engine, "int8")
    assert info.value.exit_code == EXIT_CONFIG


def test_a_precision_the_device_lacks_is_refused_naming_those_it_runs() -> None:
    lacking = [p for p, cap in (("f16", "FP16"), ("bf16", "BF16")) if cap not in _capabilities()]
    if not lacking:
        pytest.skip("this CPU runs every precision")
    with pytest.raises(ConfigError) as info:
        _load(DEMO, "openvino", lacking[0])
    assert info.value.exit_code == EXIT_CONFIG
    (problem,) = info.value.problems
    assert problem.startswith(f"model.precision: CPU cannot run {lacking[0]!r}") and "it runs f32" in problem


def test_a_device_openvino_does_not_have_is_refused_naming_those_it_has() -> None:
    with pytest.raises(ConfigError) as info:
        load_model(ModelConfig(path=DEMO, engine="openvino", device="CPU.7"), RuntimeConfig())
    assert info.value.exit_code == EXIT_CONFIG
    assert info.value.problems == [
        f"model.device: OpenVINO has no device 'CPU.7' here; it has {', '.join(ov.Core().available_devices)}, AUTO"
    ]


@pytest.mark.parametrize("device", ["AUTO", "MULTI:CPU", "HETERO:CPU"])
def test_a_device_made_of_others_picks_one_and_says_which(device: str) -> None:
    model = load_model(ModelConfig(path=DEMO, engine="openvino", device=device), RuntimeConfig())
    assert dict(model.engine.report())["device"].startswith(f"{device}: runs on CPU")
    assert len(_detect(model, _scenes()[:1])[0].scores) > 0


def test_a_dynamic_export_is_pinned_to_batch_one_and_the_configured_size(tmp_path: Path) -> None:
    path = dynamic_probe(tmp_path / "dyn.onnx")
    model = load_model(ModelConfig(path=path, engine="openvino", imgsz=(32, 96)), RuntimeConfig())
    assert list(model.engine.input_meta[0].shape) == [1, 3, 32, 96]
    assert model.contract.shape == (1, 3, 32, 96)


def test_outputs_land_in_the_bound_buffers_and_a_run_creates_no_array(tmp_path: Path) -> None:
    counter = NumpyAllocations.get()
    assert counter is not None
    model = _load(colour_probe(tmp_path / "probe.onnx"), "openvino")
    tensor = np.zeros((1, 3, 64, 64), np.float32)
    binding = model.engine.bind(tensor)
    buffer = binding.outputs[0]
    tensor[0, 0] = 1.0  # red everywhere: the input is read in place, without rebinding
    binding.run()
    assert binding.outputs[0] is buffer
    assert buffer[0, 4, 0] == pytest.approx(1.0) and buffer[0, 5, 0] == pytest.approx(0.0)
    tensor[0, 0], tensor[0, 2] = 0.0, 0.5
    with counter.counting():
        before = counter.buffers
        for _ in range(20):
            binding.run()
        assert counter.buffers == before
    assert buffer[0, 4, 0] == pytest.approx(0.0) and buffer[0, 5, 0] == pytest.approx(0.5)


def test_an_inspected_frame_on_openvino_creates_no_arrays_from_contract_check_to_verdict() -> None:
    counter = NumpyAllocations.get()
    assert counter is not None
    model = _load(DEMO, "openvino")
    inspector = Inspector(InspectConfig(zones={"left": [(0, 0), (0.5, 0), (0.5, 1), (0, 1)]}), model.labels, 3, 0.25, 100)
    path = FramePath(model, "cam0", "bgr", inspector)
    frame = Frame(_scenes()[1], 0, 0, 0, "bgr")
    for _ in range(3):
        path.run(frame)
    with counter.counting():
        before = counter.buffers
        for _ in range(10):
            done = path.run(frame)
            assert isinstance(done, Processed)
            path.verdict_record(done, None)
        assert counter.buffers == before
    assert done.inspected is not None and len(done.decoded or done.result) > 0


def test_the_full_path_accumulates_nothing_after_warm_up() -> None:
    plan = FramePipeline(_load(DEMO, "openvino"), 1280, 720, "bgr")
    frame = _scenes()[0]
    for _ in range(5):
        plan.process(frame)
    tracemalloc.start()
    try:
        baseline = tracemalloc.take_snapshot()
        for _ in range(100):
            plan.process(frame)
        grown = sum(s.size_diff for s in tracemalloc.take_snapshot().compare_to(baseline, "filename"))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 256 * 1024, peak  # the input tensor alone is 1.2 MB: a copy of it would show
    assert grown < 16 * 1024, grown


def test_the_compiled_model_is_cached_in_the_cache_folder_and_loaded_from_it(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    first = _load(DEMO, "openvino", cache_dir=cache)
    folder = cache / "openvino" / first.engine.identity.short  # a folder per model
    blobs = sorted(folder.glob("*.blob"))
    assert blobs, list(cache.rglob("*"))
    assert dict(first.engine.report())["cache"] == str(folder)
    written = [(b.stat().st_ino, b.stat().st_mtime_ns) for b in [*blobs, folder / "edged-cache.json"]]
    again = _load(DEMO, "openvino", cache_dir=cache)  # the same model and settings: read, not written again
    assert sorted(folder.glob("*.blob")) == blobs
    assert [(b.stat().st_ino, b.stat().st_mtime_ns) for b in [*blobs, folder / "edged-cache.json"]] == written
    assert _detect(again, _scenes()[:1])[0].class_ids.tolist() == _detect(first, _scenes()[:1])[0].class_ids.tolist()


def test_the_compiled_models_of_the_models_used_last_are_kept_and_the_rest_removed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # A folder per model, never removed: a line changing its model every week filled its card over the
    # years; and an earlier edged's loose compiled models stayed for ever, no longer read.
    cache = tmp_path / "cache" / "openvino"
    others = [cache / f"old{i}@{i:012x}" for i in range(5)]
    for i, other in enumerate(others):  # old0 used longest ago
        other.mkdir(parents=True)
        (other / "edged-cache.json").write_text("{}")
        (other / "1234.blob").write_bytes(b"compiled")
        os.utime(other, ns=(10**18 + i * 10**9, 10**18 + i * 10**9))
    (cache / "5678.blob").write_bytes(b"compiled by an earlier edged")
    (cache / "notes").mkdir()  # not a model's folder: left alone
    caplog.set_level(logging.INFO, logger="edged.engine_openvino")
    model = _load(DEMO, "openvino", cache_dir=tmp_path / "cache")
    kept = sorted(p.name for p in cache.iterdir())
    assert kept == sorted([model.engine.identity.short, "notes", *(other.name for other in others[2:])])
    [said] = [r.getMessage() for r in caplog.records if "removed the compiled models" in r.getMessage()]
    assert "5678.blob, old0@000000000000, old1@000000000001" in said, said


def test_a_cache_prepared_on_a_read_only_filesystem_is_read(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # Marking the model's folder used (for the models kept) is a write: on a read-only image it must
    # not cost the cache the image was prepared with.
    cache = tmp_path / "cache"
    with tmpfs(cache, "size=64m") as mounted:
        if not mounted:
            pytest.skip("a tmpfs needs root and mount")
        first = _load(DEMO, "openvino", cache_dir=cache)
        assert subprocess.run(["mount", "-o", "remount,ro", str(cache)]).returncode == 0
        caplog.set_level(logging.INFO, logger="edged.engine_openvino")
        again = _load(DEMO, "openvino", cache_dir=cache)
        assert again.engine.cache == first.engine.cache == cache / "openvino" / first.engine.identity.short
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text


def test_the_cache_folder_is_the_services_cache_directory_by_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CACHE_DIRECTORY", str(tmp_path))
    model = _load(DEMO, "openvino")
    assert list((tmp_path / "openvino" / model.engine.identity.short).glob("*.blob"))


@pytest.mark.parametrize("damage", ["cut short", "zeros"])
def test_a_compiled_model_damaged_on_the_disk_is_removed_and_compiled_again(
    tmp_path: Path, damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    """OpenVINO compiles a cut one again unasked, but runs one with zeros in it: before, boxes of size 0."""
    probe, cache = colour_probe(tmp_path / "probe.onnx"), tmp_path / "cache"
    _load(probe, "openvino", cache_dir=cache)
    (blob,) = cache.rglob("*.blob")
    damage_on_disk(blob, damage)
    with caplog.at_level(logging.WARNING):
        model = _load(probe, "openvino", cache_dir=cache)
    assert probe_box(model.engine) == PROBE_BOX
    assert [r.getMessage() for r in caplog.records] == [
        f"runtime.cache_dir: OpenVINO's compiled model {blob.name} in {blob.parent} is not as it was written (cut "
        "short or damaged, as by a power cut): removed, the model is compiled again"
    ]
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        again = _load(probe, "openvino", cache_dir=cache)  # compiled again whole, and recorded so
    assert not caplog.records and probe_box(again.engine) == PROBE_BOX and list(cache.rglob("*.blob")) == [blob]


def test_a_cache_openvino_cannot_write_on_a_full_disk_is_said(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """OpenVINO drops a blob it cannot write without a word: before, every start compiled, unsaid."""
    probe, cache = colour_probe(tmp_path / "probe.onnx"), tmp_path / "cache"
    with tmpfs(cache, "size=64k") as mounted:
        if not mounted:
            pytest.skip("a small tmpfs needs root and mount")
        (cache / "openvino").mkdir()
        fill(cache / "filler")
        with caplog.at_level(logging.WARNING):
            model = _load(probe, "openvino", cache_dir=cache)
        assert probe_box(model.engine) == PROBE_BOX
        (warning,) = [r.getMessage() for r in caplog.records]
        assert warning.startswith("runtime.cache_dir: ") and str(cache / "openvino") in warning
        assert warning.endswith("the model is compiled at every start")


def test_a_signed_model_is_compiled_afresh_not_read_from_the_cache(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A compiled model in the cache is not covered by the signature: swapped on the disk, it would run."""
    model, private, public = tmp_path / "demo.onnx", tmp_path / "signing.pem", tmp_path / "signing.pub"
    model.write_bytes(DEMO.read_bytes())
    subprocess.run(["openssl", "genpkey", "-algorithm", "ed25519", "-out", str(private)], check=True)
    subprocess.run(["openssl", "pkey", "-in", str(private), "-pubout", "-out", str(public)], check=True)
    signature_path(model).write_text(sign(model, None, private))
    cache = tmp_path / "cache"
    load_model(ModelConfig(path=model, engine="openvino"), RuntimeConfig(cache_dir=cache))  # unsigned: cached
    assert list(cache.rglob("*.blob"))
    cfg = ModelConfig(path=model, engine="openvino", require_signature=True, signature_key=public)
    with caplog.at_level(logging.WARNING):
        loaded = load_model(cfg, RuntimeConfig(cache_dir=cache))
    assert loaded.engine.cache is None  # type: ignore[attr-defined]  # OpenVINO's engine
    assert dict(loaded.engine.report())["cache"] == "none: not used with model.require_signature: " + (
        "the signature does not cover what it holds"
    )
    assert f"runtime.cache_dir {cache} is not used with model.require_signature" in caplog.text


def test_check_reports_device_plugin_and_precision() -> None:
    report = _load(DEMO, "openvino").engine.report()
    labels = [label for label, _ in report]
    assert {"engine", "device", "plugin", "precision", "cache", "threads"} <= set(labels)
    lines = dict(report)
    assert lines["device"].startswith("CPU: runs on CPU")
    assert "openvino_intel_cpu_plugin" in lines["plugin"] or "cpu" in lines["plugin"].lower()
    assert lines["precision"] == "f32: inference precision f32"


def _daemon_config(tmp_path: Path, endpoint: str) -> Path:
    return write_config(
        tmp_path / "edged.toml",
        {
            "source": {"type": "synthetic", "width": 640, "height": 360, "fps": 10.0},
            "model": {"path": str(DEMO), "engine": "openvino", "precision": "f32"},
            "runtime": {"cache_dir": str(tmp_path / "cache")},
            "publish": {"endpoints": [endpoint], "status_interval_s": 0.5},
            "thermal": {"enabled": False},
        },
    )


@pytest.mark.integration
def test_the_daemon_on_openvino_publishes_detections_over_zeromq(tmp_path: Path) -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    daemon = RunningDaemon(_daemon_config(tmp_path, endpoint), endpoint)
    try:
        messages = daemon.collect("detections", 5, timeout=60)
        assert all(isinstance(m, DetectionsMessage) and m.model.provider == "OpenVINO CPU" for m in messages)
        assert any(isinstance(m, DetectionsMessage) and m.detections for m in messages), daemon.log()
        assert daemon.stop(timeout=15) == 0, daemon.log()
    finally:
        daemon.close()
    assert list((tmp_path / "cache" / "openvino").glob("demo@*/*.blob"))


@pytest.mark.integration
@pytest.mark.parametrize("fault", ["full", "zeros"])
def test_the_daemon_on_openvino_serves_the_model_whatever_its_cache_disk_does(tmp_path: Path, fault: str) -> None:
    """`edged check` and `edged run` on a cache that cannot be written, or was damaged: one warning, and the
    model's own boxes. Before, the first was silent and the second published boxes of size 0."""
    probe, cache = colour_probe(tmp_path / "probe.onnx"), tmp_path / "cache"
    (tmp_path / "imgs").mkdir()
    cv2.imwrite(str(tmp_path / "imgs" / "red.png"), solid_frame((0, 0, 255)))
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    config = write_config(
        tmp_path / "edged.toml",
        {
            "source": {"type": "images", "path": str(tmp_path / "imgs"), "fps": 20.0, "loop": True},
            "model": {"path": str(probe), "engine": "openvino"},
            "runtime": {"cache_dir": str(cache)},
            "publish": {"endpoints": [endpoint], "status_interval_s": 0.5},
            "thermal": {"enabled": False},
        },
    )
    with contextlib.ExitStack() as stack:
        if fault == "full":
            if not stack.enter_context(tmpfs(cache, "size=64k")):
                pytest.skip("a small tmpfs needs root and mount")
            fill(cache / "filler")
            checked = run_cli("check", "--config", str(config), "--no-bind", timeout=120)
            assert checked.returncode == 0, checked.stderr
            assert checked.stderr.count("runtime.cache_dir") == 1, checked.stderr
        else:
            _load(probe, "openvino", cache_dir=cache)
            (blob,) = cache.rglob("*.blob")
            damage_on_disk(blob, "zeros")
        found, log = served_and_stopped(config, endpoint)
        assert found == [("red", (48.0, 20.0, 80.0, 44.0))], log
        said = "is not as it was written" if fault == "zeros" else "could not write its compiled model"
        assert log.count(said) == 1 and log.count("WARNING") == 1, log


@pytest.mark.integration
def test_edged_check_reports_the_device_plugin_and_precision(tmp_path: Path) -> None:
    result = run_cli("check", "--config", str(_daemon_config(tmp_path, "tcp://127.0.0.1:0")), timeout=120)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert any(line.startswith("engine     openvino ") for line in lines)
    assert "device     CPU: runs on CPU" in result.stdout
    assert any(line.startswith("plugin     CPU: ") for line in lines)
    assert "precision  f32: inference precision f32" in result.stdout
    assert "nodes run in f32: " in result.stdout
    assert result.stdout.rstrip().endswith("ok")


@pytest.mark.integration
def test_a_precision_the_device_lacks_stops_the_daemon_with_exit_78(tmp_path: Path) -> None:
    lacking = [p for p, cap in (("f16", "FP16"), ("bf16", "BF16")) if cap not in _capabilities()]
    if not lacking:
        pytest.skip("this CPU runs every precision")
    config = _daemon_config(tmp_path, f"tcp://127.0.0.1:{free_port()}")
    config.write_text(config.read_text().replace('precision = "f32"', f'precision = "{lacking[0]}"'))
    result = run_cli("run", "--config", str(config), timeout=120)
    assert result.returncode == EXIT_CONFIG
    assert f"model.precision: CPU cannot run {lacking[0]!r}" in result.stderr and "it runs f32" in result.stderr
