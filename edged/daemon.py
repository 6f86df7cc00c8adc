"""The daemon: builds every stage from the settings, runs the loop, stops cleanly.

This is the only module that knows all the stages. The loop takes the newest frame, checks it
against the contract, runs it through the `FramePipeline`, publishes the result, and between
frames does the slow housekeeping: thermal polls, status messages, the rate cap, config reloads.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

from edged.capture import Capture
from edged.config import ProviderConfig, Settings, load_config
from edged.contract import frame_problem
from edged.decode import Detections
from edged.errors import (
    EXIT_CONFIG,
    EXIT_FAILURE,
    EXIT_OK,
    ConfigError,
    ContractError,
    EdgedError,
    InferenceError,
    KeyFileError,
    ModelError,
)
from edged.messages import ModelInfo, StatusMessage
from edged.model import LoadedModel, load_model
from edged.pipeline import FramePipeline, StageTimes, detections_message
from edged.publish import Publisher, detections_topic, status_topic
from edged.service import Notifier, Signals, Watchdog, watchdog_interval_s
from edged.sources import Frame, open_source
from edged.stats import RunStats
from edged.thermal import ThermalReport, ThermalWatch

log = logging.getLogger(__name__)

TAKE_TIMEOUT_S = 0.25  # the loop comes round at least this often, frames or not
REPLAN_AFTER = 5  # consecutive frames of one new size before the buffers are re-planned
MAX_INFERENCE_FAILURES = 20  # consecutive failed runs before the daemon gives up
ERROR_LOG_INTERVAL_S = 10.0  # a burst of failing frames is one log line, then counters


@dataclass
class Progress:
    """Timestamps the watchdog reads to decide whether the pipeline is alive."""

    loop_ns: int = field(default_factory=time.monotonic_ns)
    frame_ns: int = field(default_factory=time.monotonic_ns)


class Daemon:
    """One running configuration: model, capture, publisher, thermal watch, and the loop."""

    def __init__(self, settings: Settings, config_path: Path | None, notifier: Notifier, signals: Signals) -> None:
        self.settings = settings
        self.config_path = config_path
        self.notifier = notifier
        self.signals = signals
        self.stats = RunStats()
        self.progress = Progress()
        # The camera opens (or the scene pool is drawn) while the model loads: cold start pays
        # for the slower of the two, not their sum.
        self.capture = self._start_capture()
        try:
            self._use_model(load_model(settings.model, settings.runtime))
            self.publisher = Publisher(settings.publish)
        except BaseException:
            self.capture.stop(timeout_s=1.5)
            raise
        self.thermal = ThermalWatch(settings.thermal) if settings.thermal.enabled else None
        self.report: ThermalReport | None = None
        self._seq = {"detections": itertools.count(), "status": itertools.count()}
        self._new_size: tuple[tuple[int, int], int] | None = None
        self._inference_failures = 0
        self._last_error_log = -ERROR_LOG_INTERVAL_S
        self._ready = False
        self._rate_cap: float | None = None
        self._source_fps_mark = (time.monotonic_ns(), 0)
        self._source_fps = 0.0

    # ---- building blocks -------------------------------------------------------------------

    def _start_capture(self) -> Capture:
        cfg = self.settings.source
        capture = Capture(lambda: open_source(cfg), cfg.camera_id, priority=self.settings.runtime.capture_priority)
        capture.start()
        return capture

    def _use_model(self, model: LoadedModel) -> None:
        self.model = model
        self.plan: FramePipeline | None = None  # planned on the first frame, for its size
        identity = model.engine.identity
        self.model_info = ModelInfo(name=identity.name, sha256=identity.sha256, provider=model.engine.provider)

    # ---- the loop ----------------------------------------------------------------------------

    def run(self) -> int:
        interval = watchdog_interval_s()
        watchdog = Watchdog(self.notifier, interval, self.healthy) if interval else None
        if watchdog:
            watchdog.start()
        next_status = next_thermal = time.monotonic()
        try:
            while not self.signals.stop.is_set():
                now = time.monotonic()
                self.progress.loop_ns = time.monotonic_ns()
                if self.signals.reload.is_set():
                    self.signals.reload.clear()
                    self.reload()
                if self.thermal and now >= next_thermal:
                    self._poll_thermal(self.thermal)
                    next_thermal = now + self.settings.thermal.poll_interval_s
                if now >= next_status:
                    self.publish_status()
                    next_status = now + self.settings.publish.status_interval_s
                if self.capture.state == "ended":
                    log.info("source ended: stopping")
                    return EXIT_OK
                if self._inference_failures >= MAX_INFERENCE_FAILURES and not self._fall_back_provider():
                    log.error(
                        "inference failed on %d frames in a row: stopping so that systemd restarts "
                        "edged (check the model and the execution provider)",
                        self._inference_failures,
                    )
                    return EXIT_FAILURE
                self.step()
        except ModelError as e:  # the model cannot run at all on frames of this size
            log.error("%s", e)
            return EXIT_CONFIG
        finally:
            self.shutdown(watchdog)
        return EXIT_OK

    def step(self) -> None:
        """Wait for the rate cap, take the newest frame, process and publish it."""
        if self.report is not None and self.report.rate_factor == 0.0:
            self.signals.stop.wait(TAKE_TIMEOUT_S)  # critical: inference paused, status continues
            self.progress.frame_ns = time.monotonic_ns()
            return
        started = time.monotonic()
        frame = self.capture.take(TAKE_TIMEOUT_S)
        if frame is None:
            self._ready_without_frames()
            return
        self.handle(frame)
        if self._rate_cap:
            self.signals.stop.wait(max(0.0, started + 1.0 / self._rate_cap - time.monotonic()))

    def handle(self, frame: Frame) -> None:
        plan = self._plan_for(frame)
        if plan is None:
            return
        try:
            detections, times = plan.process(frame.image)
        except InferenceError as e:
            self._inference_failures += 1
            self.stats.drop("inference_error")
            self._error_limited(
                "inference failed, frame %d skipped (%d failed so far): %s",
                frame.frame_id,
                self.stats.drops["inference_error"],
                e,
                frame=frame.frame_id,
                stage="inference",
            )
            return
        self._inference_failures = 0
        if detections.scores_above_one:
            self.stats.drop("score_above_one")
            self._error_limited(
                "the model gave %d score(s) above 1 on frame %d, dropped (%d frame(s) so far): scores must "
                "be probabilities, so check model.scale, mean and std against how the model was trained, "
                "and that its head ends in a sigmoid",
                detections.scores_above_one,
                frame.frame_id,
                self.stats.drops["score_above_one"],
                frame=frame.frame_id,
                stage="decode",
            )
        age_ms = (time.monotonic_ns() - frame.t_capture_ns) / 1e6
        self.stats.record(times.preprocess_ms, times.inference_ms, times.decode_ms, age_ms)
        self.progress.frame_ns = time.monotonic_ns()
        if len(detections) or self.settings.publish.publish_empty:
            self._publish_detections(frame, plan, detections, times, age_ms)
        if not self._ready:
            self._ready = True
            self.notifier.ready(self.status_line())
            log.info("first frame processed: ready", extra={"CAMERA": self.settings.source.camera_id})

    def _error_limited(self, message: str, *args: object, frame: int, stage: str) -> None:
        """Log a per-frame error at most once per ERROR_LOG_INTERVAL_S; the counters carry the rest."""
        now = time.monotonic()
        if now - self._last_error_log >= ERROR_LOG_INTERVAL_S:
            self._last_error_log = now
            log.error(message, *args, extra={"FRAME": frame, "STAGE": stage})

    def _plan_for(self, frame: Frame) -> FramePipeline | None:
        """The plan for this frame, re-planned after a lasting size change; None rejects it."""
        declared = self.settings.source.channel_order
        if self.plan is None:
            h, w = frame.image.shape[:2] if frame.image.ndim >= 2 else (0, 0)
            self.plan = FramePipeline(self.model, w, h, declared)
        problem = frame_problem(frame.image, frame.channel_order, self.plan.spec)
        if problem is None:
            self._new_size = None
            return self.plan
        if problem == "size" and self._lasting_size_change(frame):
            h, w = frame.image.shape[:2]
            log.warning(
                "frame size changed to %dx%d: re-planning buffers", w, h, extra={"CAMERA": self.settings.source.camera_id}
            )
            self.plan = FramePipeline(self.model, w, h, declared)
            return self.plan
        self.stats.drop("bad_frame_" + problem)
        if self.stats.drops["bad_frame_" + problem] == 1:
            log.warning(
                "frame %d rejected (%s): not what source declared (%dx%d %s)",
                frame.frame_id,
                problem,
                self.plan.spec.width,
                self.plan.spec.height,
                declared,
                extra={"FRAME": frame.frame_id, "STAGE": "contract"},
            )
        return None

    def _lasting_size_change(self, frame: Frame) -> bool:
        size = (frame.image.shape[1], frame.image.shape[0])
        seen = self._new_size[1] + 1 if self._new_size and self._new_size[0] == size else 1
        self._new_size = (size, seen)
        return seen >= REPLAN_AFTER

    def _ready_without_frames(self) -> None:
        """A camera missing at start-up: be up and honest about it rather than time out."""
        if not self._ready and self.capture.state == "lost":
            self._ready = True
            self.notifier.ready(self.status_line())

    # ---- messages ----------------------------------------------------------------------------

    def _publish_detections(
        self, frame: Frame, plan: FramePipeline, detections: Detections, times: StageTimes, age_ms: float
    ) -> None:
        msg = detections_message(
            self.settings.source.camera_id,
            next(self._seq["detections"]),
            frame,
            plan.box_map,
            self.model,
            self.model_info,
            detections,
            times,
            age_ms,
            self.report.state if self.report else "unknown",
        )
        topic = detections_topic(self.settings.publish.topic_prefix, self.settings.source.camera_id)
        self.publisher.send(topic, msg.model_dump_json().encode())

    def drops(self) -> dict[str, int]:
        capture = self.capture.stats()
        drops = dict(self.stats.drops)
        drops["stale"] = capture.dropped_stale
        drops["read_error"] = capture.read_errors
        drops.update(self.publisher.drops)
        return drops

    def publish_status(self) -> None:
        self.stats.update_fps()
        self._update_rate_cap()
        msg = StatusMessage(
            camera_id=self.settings.source.camera_id,
            seq=next(self._seq["status"]),
            time_ns=time.time_ns(),
            uptime_s=round(self.stats.uptime_s(), 3),
            fps=round(self.stats.fps, 2),
            frames_processed=self.stats.frames_processed,
            source_state=self.capture.state,
            drops=self.drops(),
            latency=self.stats.latencies(),
            rate_cap_fps=round(self._rate_cap, 2) if self._rate_cap is not None else None,
            thermal=self.report.to_dict() if self.report else None,
            model=self.model_info,
        )
        topic = status_topic(self.settings.publish.topic_prefix, self.settings.source.camera_id)
        self.publisher.send(topic, msg.model_dump_json().encode())
        self.notifier.status(self.status_line())

    def status_line(self) -> str:
        thermal = self.report.summary() if self.report else "thermal off"
        cap = f" cap {self._rate_cap:.1f}fps" if self._rate_cap else ""
        return (
            f"{self.stats.fps:.1f} fps{cap} | camera {self.capture.state} | {thermal} | "
            f"{self.stats.frames_processed} frames | model {self.model.engine.identity.short}"
        )

    # ---- housekeeping ------------------------------------------------------------------------

    def _poll_thermal(self, thermal: ThermalWatch) -> None:
        previous = self.report.state if self.report else None
        self.report = thermal.poll()
        if previous is not None and previous != self.report.state:
            self._update_rate_cap()
            self.notifier.status(self.status_line())

    def _update_rate_cap(self) -> None:
        """Cap = thermal factor x full rate: max_fps, else the rate the camera delivers.

        Capture keeps reading at the camera's pace whatever we process, so its count of
        captured frames measures the full rate even while the loop is capped.
        """
        now, captured = time.monotonic_ns(), self.capture.stats().frames_captured
        then, before = self._source_fps_mark
        if now - then > 5e8:
            self._source_fps = (captured - before) * 1e9 / (now - then)
            self._source_fps_mark = (now, captured)
        factor = self.report.rate_factor if self.report else 1.0
        full = self.settings.service.max_fps or self._source_fps
        if factor < 1.0 and full > 0:
            self._rate_cap = full * factor
        else:
            self._rate_cap = self.settings.service.max_fps or None

    def _fall_back_provider(self) -> bool:
        """Drop the provider that keeps failing and carry on with the next one in the list."""
        providers = self.model.engine.providers
        if len(providers) < 2:
            return False
        remaining = [ProviderConfig(name=name, options=options) for name, options in providers[1:]]
        runtime = self.settings.runtime.model_copy(update={"providers": remaining})
        try:
            model = load_model(self.settings.model, runtime)
        except (ModelError, ContractError) as e:
            log.error("cannot fall back from %s: %s", providers[0][0], e)
            return False
        log.warning(
            "inference failed on %d frames in a row with %s: falling back to %s",
            self._inference_failures,
            providers[0][0],
            model.engine.provider,
            extra={"STAGE": "inference", "MODEL": model.engine.identity.short},
        )
        self.settings = self.settings.model_copy(update={"runtime": runtime})
        self._use_model(model)
        self._inference_failures = 0
        return True

    def healthy(self) -> bool:
        """Progress for the watchdog: the loop turns, and frames flow or a reconnect is alive."""
        now = time.monotonic_ns()
        limit = self.settings.service.stall_timeout_s * 1e9
        if now - self.progress.loop_ns > limit:
            return False
        capture = self.capture.stats()
        if not capture.alive and self.capture.state != "ended":
            return False  # the capture thread died: only a restart brings the camera back
        if now - self.progress.frame_ns <= limit:
            return True
        return self.capture.state in ("lost", "starting") and now - capture.last_progress_ns <= limit

    def reload(self) -> None:
        """SIGHUP: apply a new config and model, or keep everything as it is if they are bad."""
        log.info("reloading configuration from %s", self.config_path)
        self.notifier.reloading()
        try:
            new = load_config(self.config_path)
            model = load_model(new.model, new.runtime)
        except (ConfigError, ModelError, ContractError) as e:
            log.error("reload refused, keeping the running configuration: %s", e)
            self.notifier.ready(self.status_line())
            return
        if new.publish != self.settings.publish:
            # The bound socket keeps its endpoints and options, so the settings must say so too
            # (topics are built from them).
            log.warning("publish settings changed: restart edged to apply them")
            new = new.model_copy(update={"publish": self.settings.publish})
        try:
            self.publisher.reload_client_keys()
        except KeyFileError as e:
            log.error("subscriber keys not reloaded, the previous allow-list stays: %s", e)
        source_changed = new.source != self.settings.source
        self.settings = new
        if source_changed:
            self.capture.stop()
            self.capture = self._start_capture()
        self._use_model(model)
        self.thermal = ThermalWatch(new.thermal) if new.thermal.enabled else None
        log.info("reloaded: model %s", model.engine.identity.short)
        self.notifier.ready(self.status_line())

    def shutdown(self, watchdog: Watchdog | None) -> None:
        self.notifier.stopping()
        if watchdog:
            watchdog.stop()
        self.capture.stop(timeout_s=1.5)
        self.publish_status()
        self.publisher.close()


def run(config_path: Path | None, settings: Settings) -> int:
    """``edged run``: returns the process exit code."""
    notifier = Notifier()
    signals = Signals()
    signals.install()
    try:
        daemon = Daemon(settings, config_path, notifier, signals)
    except EdgedError as e:
        log.error("%s", e)
        notifier.status(f"refused to start: {e}" if e.exit_code == EXIT_CONFIG else f"cannot start: {e}")
        return e.exit_code
    try:
        return daemon.run()
    finally:
        notifier.close()
