"""The daemon: composes the stages from the settings, runs the loop, stops cleanly.

The loop takes the newest frame, runs it through the camera's `FramePath`, and publishes the
result; in request mode (`edged.trigger`) it instead answers each request with a frame captured
after the request arrived. Between frames it does the slow housekeeping: thermal polls, status messages, the rate
cap, config reloads. Each of those policies lives in its own small module (`edged.ratecap`,
`edged.health`, `edged.status`, `edged.reload`); this one only wires them and turns the loop.
"""

from __future__ import annotations

import itertools
import logging
import time
from pathlib import Path

from edged.capture import Capture
from edged.config import ProviderConfig, Settings
from edged.errors import EXIT_CONFIG, EXIT_FAILURE, EXIT_OK, EdgedError, KeyFileError, ModelError
from edged.health import Health
from edged.messages import TriggerError, VerdictMessage
from edged.model import LoadedModel, load_model
from edged.pipeline import FramePath, Processed, Rejected, frame_path, verdict_message
from edged.publish import Publisher, detections_topic, status_topic, verdict_topic
from edged.ratecap import RateCap
from edged.reload import load_replacement
from edged.service import Notifier, Signals, Watchdog, watchdog_interval_s
from edged.sources import Frame, open_source
from edged.stats import RunStats
from edged.status import Snapshot
from edged.thermal import ThermalReport, ThermalWatch
from edged.trigger import Request, TriggerServer

log = logging.getLogger(__name__)

TAKE_TIMEOUT_S = 0.25  # the loop comes round at least this often, frames or not
MAX_INFERENCE_FAILURES = 20  # consecutive failed runs before the daemon gives up
ERROR_LOG_INTERVAL_S = 10.0  # a burst of failing frames is one log line, then counters


class Daemon:
    """One running configuration: model, capture, publisher, thermal watch, and the loop."""

    def __init__(self, settings: Settings, config_path: Path | None, notifier: Notifier, signals: Signals) -> None:
        self.settings = settings
        self.config_path = config_path
        self.notifier = notifier
        self.signals = signals
        self.stats = RunStats()
        self.health = Health(settings.service.stall_timeout_s)
        self.rate_cap = RateCap(settings.service.max_fps)
        # The camera opens (or the scene pool is drawn) while the model loads: cold start pays
        # for the slower of the two, not their sum.
        self.capture = self._start_capture()
        try:
            self._use_model(load_model(settings.model, settings.runtime))
            self.publisher = Publisher(settings.publish)
            self.trigger = self._start_trigger()
        except BaseException:
            self.capture.stop(timeout_s=1.5)
            raise
        self.thermal = ThermalWatch(settings.thermal) if settings.thermal.enabled else None
        self.report: ThermalReport | None = None
        self._seq = {"detections": itertools.count(), "status": itertools.count(), "verdict": itertools.count()}
        self._inference_failures = 0
        self._last_error_log = -ERROR_LOG_INTERVAL_S
        self._next_status = self._next_thermal = time.monotonic()

    def _start_capture(self) -> Capture:
        cfg = self.settings.source
        capture = Capture(lambda: open_source(cfg), cfg.camera_id, priority=self.settings.runtime.capture_priority)
        capture.start()
        return capture

    def _start_trigger(self) -> TriggerServer | None:
        if self.settings.trigger.mode != "request":
            return None
        try:
            return TriggerServer(self.settings.trigger, self.settings.publish, self.settings.source.camera_id)
        except BaseException:
            self.publisher.close()
            raise

    def _use_model(self, model: LoadedModel, path: FramePath | None = None) -> None:
        self.model = model
        self.path = path or frame_path(self.settings, model)

    # ---- the loop ----------------------------------------------------------------------------

    def run(self) -> int:
        """Loop until stopped, the source ends or inference keeps failing; returns the exit code."""
        interval = watchdog_interval_s()
        watchdog = Watchdog(self.notifier, interval, self.healthy) if interval else None
        if watchdog:
            watchdog.start()
        try:
            while not self.signals.stop.is_set():
                if self.signals.reload.is_set():
                    self.signals.reload.clear()
                    self.reload()
                self.housekeeping()
                if self.capture.fatal is not None:
                    return self.capture.fatal.exit_code  # logged by the capture thread
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

    def housekeeping(self) -> None:
        """Between frames, and while a request waits for its frame: progress, thermal polls, status."""
        now = time.monotonic()
        self.health.loop_turned()
        if self.thermal and now >= self._next_thermal:
            self._poll_thermal(self.thermal)
            self._next_thermal = now + self.settings.thermal.poll_interval_s
        if now >= self._next_status:
            self.publish_status()
            self._next_status = now + self.settings.publish.status_interval_s

    def step(self) -> None:
        """Wait for the rate cap, take the newest frame, process and publish it (free mode), or
        answer the next request (request mode)."""
        if self.trigger is not None:
            self._serve(self.trigger)
            return
        if self.report is not None and self.report.rate_factor == 0.0:
            self.signals.stop.wait(TAKE_TIMEOUT_S)  # critical: inference paused, status continues
            self.health.frame_done()
            return
        started = time.monotonic()
        frame = self.capture.take(TAKE_TIMEOUT_S)
        if frame is None:
            self._announce_ready(frame_processed=False)
            return
        self.handle(frame)
        self.signals.stop.wait(self.rate_cap.wait_s(started, time.monotonic()))

    def _serve(self, trigger: TriggerServer) -> None:
        """Request mode: answer the oldest request. Before READY=1 a frame goes through the model
        unpublished, which proves camera and model and warms the session up."""
        if not self.health.ready:
            frame = self.capture.take(TAKE_TIMEOUT_S)
            outcome = self.path.run(frame) if frame is not None else None
            if isinstance(outcome, Rejected):
                self._reject(outcome)
            self._announce_ready(frame_processed=isinstance(outcome, Processed))
        request = trigger.next(TAKE_TIMEOUT_S if self.health.ready else 0.0)
        self.health.frame_done()  # waiting for requests is progress in this mode
        if request is not None:
            trigger.answer(request, self._answer(trigger, request))

    def _answer(self, trigger: TriggerServer, request: Request) -> VerdictMessage | TriggerError:
        """The verdict of the first good frame captured after ``request`` arrived, or why there is none.

        A frame captured before the request (one waiting in the latest-frame slot, picamera2's
        queued one) is passed over: its capture time, on the same monotonic clock as the
        arrival, says so. Requests arriving meanwhile are read and stamped as frames are awaited.
        """
        timeout_s = self.settings.trigger.timeout_s
        deadline_ns = request.arrived_ns + int(timeout_s * 1e9)
        while (left_ns := deadline_ns - time.monotonic_ns()) > 0:
            self.housekeeping()
            if self.signals.stop.is_set():
                return trigger.error(request.part_id, "stopping", "edged is stopping")
            if self.report is not None and self.report.rate_factor == 0.0:
                return trigger.error(request.part_id, "thermal_critical", "inference is paused until the board cools")
            capture = self.capture.stats()
            if capture.state in ("lost", "ended"):
                why = f": {capture.last_error}" if capture.last_error else ""
                return trigger.error(request.part_id, "camera_lost", f"the camera is {capture.state}{why}")
            trigger.collect()
            frame = self.capture.take(min(left_ns / 1e9, TAKE_TIMEOUT_S))
            if frame is None or frame.t_capture_ns <= request.arrived_ns:
                continue
            outcome = self.handle(frame, triggered=True, part_id=request.part_id)
            if isinstance(outcome, VerdictMessage):
                return outcome
            if isinstance(outcome, Rejected) and outcome.reason == "inference_error":
                return trigger.error(request.part_id, "inference_failed", outcome.detail)
        return trigger.error(request.part_id, "timeout", f"no frame captured after the request within {timeout_s:g} s")

    def handle(
        self, frame: Frame, *, triggered: bool = False, part_id: str | None = None
    ) -> VerdictMessage | Rejected | None:
        """One frame: through the model, counted, published; a rejected frame is counted and logged.

        Returns the frame's verdict message (None without ``[inspect]``), or the `Rejected`. A
        triggered frame is published whatever ``publish.publish_empty`` says.
        """
        outcome = self.path.run(frame)
        if isinstance(outcome, Rejected):
            self._reject(outcome)
            return outcome
        self._inference_failures = 0
        detections, times = outcome.detections, outcome.times
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
        self.stats.record(times.preprocess_ms, times.inference_ms, times.decode_ms, outcome.age_ms)
        self.health.frame_done()
        verdict = None
        if triggered or len(detections) or self.settings.publish.publish_empty:
            verdict = self._publish_detections(outcome, part_id)
        self._announce_ready(frame_processed=True)
        return verdict

    def _reject(self, rejected: Rejected) -> None:
        self.stats.drop(rejected.reason)
        count, frame_id = self.stats.drops[rejected.reason], rejected.frame.frame_id
        if rejected.reason == "inference_error":
            self._inference_failures += 1
            self._error_limited(
                "inference failed, frame %d skipped (%d failed so far): %s",
                frame_id,
                count,
                rejected.detail,
                frame=frame_id,
                stage="inference",
            )
        elif count == 1:
            log.warning(
                "frame %d rejected (%s): %s",
                frame_id,
                rejected.reason.removeprefix("bad_frame_"),
                rejected.detail,
                extra={"FRAME": frame_id, "STAGE": "contract"},
            )

    def _error_limited(self, message: str, *args: object, frame: int, stage: str) -> None:
        """Log a per-frame error at most once per ERROR_LOG_INTERVAL_S; the counters carry the rest."""
        now = time.monotonic()
        if now - self._last_error_log >= ERROR_LOG_INTERVAL_S:
            self._last_error_log = now
            log.error(message, *args, extra={"FRAME": frame, "STAGE": stage})

    def _announce_ready(self, *, frame_processed: bool) -> None:
        if self.health.should_announce(frame_processed=frame_processed, capture_state=self.capture.state):
            self.notifier.ready(self.snapshot().line())
            if frame_processed:
                log.info("first frame processed: ready", extra={"CAMERA": self.settings.source.camera_id})

    # ---- messages ----------------------------------------------------------------------------

    def _publish_detections(self, done: Processed, part_id: str | None) -> VerdictMessage | None:
        state = self.report.state if self.report else "unknown"
        msg = self.path.message(done, seq=next(self._seq["detections"]), thermal_state=state, part_id=part_id)
        topic = detections_topic(self.settings.publish.topic_prefix, self.settings.source.camera_id)
        self.publisher.send(topic, msg.model_dump_json().encode())
        verdict = verdict_message(msg, next(self._seq["verdict"]))
        if verdict is not None:
            topic = verdict_topic(self.settings.publish.topic_prefix, self.settings.source.camera_id)
            self.publisher.send(topic, verdict.model_dump_json().encode())
        return verdict

    def snapshot(self) -> Snapshot:
        return Snapshot(
            camera_id=self.settings.source.camera_id,
            stats=self.stats,
            capture=self.capture.stats(),
            publish_drops=self.publisher.drops,
            rate_cap_fps=self.rate_cap.fps,
            thermal=self.report,
            model=self.model.info,
            model_short=self.model.engine.identity.short,
        )

    def publish_status(self) -> None:
        self.stats.update_fps()
        self._update_rate_cap()
        snapshot = self.snapshot()
        topic = status_topic(self.settings.publish.topic_prefix, self.settings.source.camera_id)
        self.publisher.send(topic, snapshot.message(next(self._seq["status"])).model_dump_json().encode())
        self.notifier.status(snapshot.line())

    # ---- housekeeping ------------------------------------------------------------------------

    def _poll_thermal(self, thermal: ThermalWatch) -> None:
        previous = self.report.state if self.report else None
        self.report = thermal.poll()
        if previous is not None and previous != self.report.state:
            self._update_rate_cap()
            self.notifier.status(self.snapshot().line())

    def _update_rate_cap(self) -> None:
        self.rate_cap.update(self.capture.stats().frames_captured, self.report.rate_factor if self.report else 1.0)

    def _fall_back_provider(self) -> bool:
        """Drop the provider that keeps failing and carry on with the next one in the list."""
        providers = self.model.engine.providers
        if len(providers) < 2:
            return False
        remaining = [ProviderConfig(name=name, options=options) for name, options in providers[1:]]
        runtime = self.settings.runtime.model_copy(update={"providers": remaining})
        try:
            model = load_model(self.settings.model, runtime)
        except EdgedError as e:
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
        """Progress for the watchdog (`edged.health`)."""
        return self.health.healthy(self.capture.stats())

    def reload(self) -> None:
        """SIGHUP: apply a new config and model, or keep everything as it is if they are bad."""
        log.info("reloading configuration from %s", self.config_path)
        self.notifier.reloading()
        try:
            new, model = load_replacement(self.config_path, self.settings)
            path = frame_path(new, model)
        except EdgedError as e:
            log.error("reload refused, keeping the running configuration: %s", e)
            self.notifier.ready(self.snapshot().line())
            return
        try:
            self.publisher.reload_client_keys()
            if self.trigger is not None:
                self.trigger.reload_client_keys()
        except KeyFileError as e:
            log.error("subscriber keys not reloaded, the previous allow-list stays: %s", e)
        source_changed = new.source != self.settings.source
        self.settings = new
        if source_changed:
            self.capture.stop()
            self.capture = self._start_capture()
        self._use_model(model, path)
        self.rate_cap = RateCap(new.service.max_fps)
        self.thermal = ThermalWatch(new.thermal) if new.thermal.enabled else None
        log.info("reloaded: model %s", model.engine.identity.short)
        self.notifier.ready(self.snapshot().line())

    def shutdown(self, watchdog: Watchdog | None) -> None:
        self.notifier.stopping()
        if watchdog:
            watchdog.stop()
        self.capture.stop(timeout_s=1.5)
        if self.trigger is not None:
            self.trigger.close()
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
