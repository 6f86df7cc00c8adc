"""``edged.candidate``: a reload's candidate trial, loaded beside the reload's model and said once it starts;
a provider fallback's, the candidate following the live model onto the providers left."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import pytest
from daemon import write_config
from filesystems import opening_stalled
from onnx_models import colour_probe, failing_probe, solid_frame
from waiting import wait_for

from edged.candidate import Candidate
from edged.config import Settings, load_config
from edged.model import LoadedModel, load_model
from edged.pipeline import Processed, frame_path
from edged.reload import Fallback, Reloads
from edged.shadow import Shadow, Swap
from edged.sources.base import Frame


def test_a_reloads_candidate_is_said_as_its_trial_starts_not_as_it_loads(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # It loads with the reload's model, and the reload may then be refused: said as it loaded, "the
    # candidate did not load" was logged for a trial that never replaced the one running.
    probe = colour_probe(tmp_path / "probe.onnx")
    (tmp_path / "broken.onnx").write_bytes(b"not a model")
    control = f"ipc://{tmp_path}/control.sock"

    def settings(candidate: str) -> Settings:
        sections = {
            "source": {"type": "synthetic"},
            "model": {"path": str(probe)},
            "model.candidate": {"path": str(tmp_path / candidate), "control": control},
            "publish": {"endpoints": ["tcp://127.0.0.1:5999"]},
        }
        return load_config(write_config(tmp_path / f"{candidate}.toml", sections))

    running, broken = settings("probe.onnx"), settings("broken.onnx")
    live = load_model(running.model, running.runtime)
    with caplog.at_level(logging.INFO, logger="edged"):
        candidate = Candidate(running, live)
        try:
            assert "candidate model probe@" in caplog.text and "on trial beside the live model" in caplog.text
            caplog.clear()
            shadow = candidate.trial_for(broken, live)
            assert shadow is not None and shadow.state == "failed" and "did not load" in (shadow.error or "")
            assert "did not load" not in caplog.text  # loaded, not yet its trial
            report = candidate.report()
            assert report is not None and report.state == "on_trial"  # the running trial goes on meanwhile
            candidate.reload(broken, shadow)
            assert "the candidate did not load" in caplog.text and "the live model goes on alone" in caplog.text
            report = candidate.report()
            assert report is not None and report.state == "failed"
        finally:
            candidate.close()


PROVIDERS = [{"name": "AzureExecutionProvider"}, {"name": "CPUExecutionProvider"}]  # Azure takes no node: CPU runs
AZURE, CPU = "AzureExecutionProvider", "CPUExecutionProvider"


def _on_two_providers(tmp_path: Path) -> tuple[Settings, LoadedModel, Candidate]:
    """A live model and a candidate on two providers, the candidate on trial: it fails on bright frames."""
    probe, candidate = colour_probe(tmp_path / "probe.onnx"), failing_probe(tmp_path / "candidate.onnx")
    sections = {
        "source": {"type": "synthetic"},
        "model": {"path": str(probe)},
        "model.candidate": {"path": str(candidate), "control": f"ipc://{tmp_path}/control.sock", "sample_every": 1},
        "publish": {"endpoints": ["tcp://127.0.0.1:5999"]},
        "runtime": {"providers": PROVIDERS},
    }
    running = load_config(write_config(tmp_path / "edged.toml", sections))
    live = load_model(running.model, running.runtime, lanes=running.lanes())
    return running, live, Candidate(running, live)


def _fallback(running: Settings, live: LoadedModel, candidate: Candidate, stalled: Path) -> Fallback:
    """The fallback from ``live``'s first provider, the candidate's models with it, switched in: loaded
    on its own thread, which waits on opening ``stalled`` while the loop's turns go on."""
    reloads = Reloads(None, threading.Event(), lambda: None, requests=False, trial_for=candidate.trial_for)
    sighup = threading.Event()
    with opening_stalled(stalled) as waiting:
        assert reloads.fall_back(running, live, running.source, 20, candidate.follower)
        assert wait_for(waiting, timeout_s=20)
        assert reloads.take(sighup, running) is None  # the loop's turn: nothing waits for the file
    got: list[Fallback] = []

    def turn() -> bool:
        if isinstance(outcome := reloads.take(sighup, running), Fallback):
            got.append(outcome)
        return bool(got)

    assert wait_for(turn, timeout_s=60)
    assert reloads.takes_over(got[0], live)
    candidate.fell_back(got[0].candidate, got[0].swap)
    return got[0]


def _processed(settings: Settings, model: LoadedModel, bgr: tuple[int, int, int]) -> Processed:
    done = frame_path(settings, model, settings.source[0]).run(Frame(solid_frame(bgr), 1, time.monotonic_ns(), 0, "bgr"))
    assert isinstance(done, Processed)
    return done


def test_a_fallback_carries_the_candidate_on_trial_onto_the_providers_left_and_starts_its_trial_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # The candidate stayed on the provider dropped: its frames failed there, counted against it, so
    # that no candidate could pass the gate, and one promoted by force brought the provider back.
    running, live, candidate = _on_two_providers(tmp_path)
    try:
        before = candidate.shadow
        assert before is not None and before.model is not None and before.model.engine.provider == AZURE
        before.observe("cam0", _processed(running, live, (255, 255, 255)))
        assert before.run(10.0) and before.tally.failed_frames == 1  # as if on the broken provider
        caplog.set_level(logging.INFO, logger="edged")
        fallback = _fallback(running, live, candidate, tmp_path / "candidate.onnx")
        after = candidate.shadow
        assert after is not None and after is not before and after.model is not None
        assert after.model.engine.provider == CPU and after.state == "on_trial"
        assert after.settings.runtime == fallback.settings.runtime
        report = candidate.report()
        assert report is not None and report.failed_frames == 0 and report.frames == 0 and report.error is None
        assert "the candidate follows the live model onto CPUExecutionProvider: its trial starts again" in caplog.text
        after.observe("cam0", _processed(fallback.settings, fallback.swap.model, (30, 30, 30)))
        assert after.run(10.0) and after.tally.frames == 1  # compared with the live model on the providers left
        promoted = after.promote(fallback.swap)
        assert promoted.model.engine.provider == CPU  # promoted, the dropped provider does not come back
    finally:
        candidate.close()


def _promoted(running: Settings, live: LoadedModel, candidate: Candidate) -> tuple[Shadow, Swap]:
    """The candidate promoted over ``live`` (by force): its trial, and the model now serving with its path."""
    shadow = candidate.shadow
    assert shadow is not None
    return shadow, shadow.promote(Swap(live, {"cam0": frame_path(running, live, running.source[0])}))


def test_a_fallback_after_a_promotion_loads_the_model_kept_for_rollback_on_the_providers_left(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # The model a promotion replaced stayed on the provider dropped: a rollback brought it back, to
    # fail 20 frames there and fall back again.
    running, live, candidate = _on_two_providers(tmp_path)
    try:
        shadow, promoted = _promoted(running, live, candidate)
        caplog.set_level(logging.INFO, logger="edged")
        fallback = _fallback(running, promoted.model, candidate, tmp_path / "probe.onnx")  # the kept model's file
        assert candidate.shadow is shadow and shadow.state == "live"  # a promotion's state, its tally kept
        kept = shadow.previous
        assert kept is not None and kept is not live and kept.engine.provider == CPU
        assert kept.info.sha256 == live.info.sha256 and shadow.report().model == kept.info
        assert "the model kept for rollback follows the live model onto CPUExecutionProvider" in caplog.text
        back = shadow.rollback()
        assert back is not None and back.model is kept and set(back.paths) == {"cam0"}
        assert isinstance(back.paths["cam0"].run(Frame(solid_frame((30, 30, 30)), 1, 0, 0, "bgr")), Processed)
        assert shadow.state == "on_trial" and shadow.model is fallback.swap.model  # on trial on the providers left
    finally:
        candidate.close()


def test_a_model_kept_for_rollback_that_does_not_load_on_the_providers_left_stays_as_it_was_said(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    running, live, candidate = _on_two_providers(tmp_path)
    try:
        shadow, promoted = _promoted(running, live, candidate)
        (tmp_path / "probe.onnx").write_bytes(b"not a model any more")
        caplog.set_level(logging.INFO, logger="edged")
        fallback = _fallback(running, promoted.model, candidate, tmp_path / "candidate.onnx")
        assert fallback.swap.model.engine.provider == CPU  # the live fallback is not held back by it
        assert shadow.previous is live and shadow.model is fallback.swap.model
        said = "the model kept for rollback, probe@"
        assert said in caplog.text and "did not load on CPUExecutionProvider" in caplog.text
        assert "a rollback brings it back on AzureExecutionProvider" in caplog.text
    finally:
        candidate.close()
