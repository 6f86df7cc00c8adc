"""The daemon: composes the stages from the settings, runs the loop, stops cleanly.

The loop takes the newest frame, runs it through the camera's `FramePath`, and publishes the
result; in request mode (`edged.trigger`) it instead answers each request with a frame captured
after the request arrived. Between frames it does the slow housekeeping: thermal polls, status messages, the rate
cap, config reloads. Each of those policies lives in its own small module (`edged.ratecap`,
`edged.health`, `edged.status`, `edged.reload`); this one only wires them and turns the loop.
The HTTP server (`edged.http`) gets the status as it is published, a frame only when its live
view asks for one, and asks the health policy itself.
"""

from __future__ import annotations

import itertools
import logging
import time
from pathlib import Path

from edged.capture import Capture
from edged.config import ProviderConfig, Settings
from edged.errors import EXIT_CONFIG, EXIT_FAILURE, EXIT_OK, EdgedError, KeyFileError, ModelError
from edged.evidence import EvidenceWriter
from edged.health import Health
from edged.http import HttpConfig, HttpServer
from edged.messages import TriggerError, VerdictMessage
from edged.model import LoadedModel, load_model
from edged.mqtt import MqttOutput
from edged.pipeline import Processed, Rejected, frame_path, verdict_message
from edged.publish import Publisher, detections_topic, status_topic, verdict_topic
from edged.ratecap import RateCap
from edged.reload import Replacement, load_replacement
from edged.service import Notifier, Signals, Watchdog, exit_safely, watchdog_interval_s
from edged.sources import Frame, open_source
from edged.sources.base import SourceBase
from edged.stats import RunStats
from edged.status import Snapshot
from edged.thermal import ThermalReport, ThermalWatch
from edged.trigger import Request, TriggerServer

log = logging.getLogger(__name__)

TAKE_TIMEOUT_S = 0.25  # the loop comes round at least this often, frames or not
MAX_INFERENCE_FAILURES = 20  # consecutive failed runs before the daemon gives up
ERROR_LOG_INTERVAL_S = 10.0  # a burst of failing frames is one log line, then counters
# How long an exit waits for the capture thread to release the camera. A camera call that takes
# longer (an 8K JPEG decodes in seconds on a Pi) is abandoned: `run` then exits without
# finalising, which is safe, so this bounds the stop time rather than guarding the exit.
CAPTURE_STOP_WAIT_S = 1.0
EVIDENCE_STOP_S = 1.0  # at stop, time left to the evidence writer to finish its queue (a few ms per frame)


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
        self.capture = self._start_capture(settings.source)
        try:
            self._use_model(load_model(settings.model, settings.runtime))
            self.http = self._http_server(settings.http)
            self.publisher = Publisher(settings.publish, settings.source.camera_id)
            self.mqtt = self._start_mqtt()
            self.trigger = self._start_trigger()
        except BaseException:
            self.capture.stop(timeout_s=CAPTURE_STOP_WAIT_S)
            raise
        self.http.start()
        self.thermal = ThermalWatch(settings.thermal) if settings.thermal.enabled else None
        self.report: ThermalReport | None = None
        self.evidence = self._start_evidence()
        self._seq = {"detections": itertools.count(), "status": itertools.count(), "verdict": itertools.count()}
        self._inference_failures = 0
        self._last_error_log = -ERROR_LOG_INTERVAL_S
        self._replacement: Replacement | None = None  # a reload on trial: it takes over on its first frame
        self._next_status = self._next_thermal = time.monotonic()

    def _start_capture(self, cfg: SourceBase) -> Capture:
        capture = Capture(lambda: open_source(cfg), cfg.camera_id, priority=self.settings.runtime.capture_priority)
        capture.start()
        return capture

    def _http_server(self, cfg: HttpConfig) -> HttpServer:
        inspect = self.settings.inspect
        return HttpServer(cfg, self.health_problem, inspect.zones if inspect else {})

    def _start_mqtt(self) -> MqttOutput | None:
        cfg = self.settings.mqtt
        return MqttOutput(cfg, self.settings.source.camera_id) if cfg is not None else None

    def _start_evidence(self) -> EvidenceWriter | None:
        cfg = self.settings.evidence
        if cfg is None:
            return None
        writer = EvidenceWriter(cfg, self.settings.source.camera_id)
        writer.start()
        return writer

    def _start_trigger(self) -> TriggerServer | None:
        if self.settings.trigger.mode != "request":
            return None
        try:
            trigger = TriggerServer(self.settings.trigger, self.settings.publish, self.settings.source.camera_id)
        except BaseException:
            self.publisher.close()
            self.http.close()
            if self.mqtt:
                self.mqtt.close()
            raise
        if self.mqtt:
            trigger.attach(self.mqtt)
        return trigger

    def _use_model(self, model: LoadedModel) -> None:
        self.model = model
        self.path = frame_path(self.settings, model)

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
        if self._replacement is not None:
            self._try_replacement(self._replacement, frame)
        else:
            self.handle(frame)
        self.signals.stop.wait(self.rate_cap.wait_s(started, time.monotonic()))

    def _serve(self, trigger: TriggerServer) -> None:
        """Request mode: answer the oldest request. Before READY=1 a frame goes through the model
        unpublished, which proves camera and model and warms the session up; a reload on trial
        is tried on the next frame, as in free mode."""
        if not self.health.ready or self._replacement is not None:
            frame = self.capture.take(TAKE_TIMEOUT_S)
            if frame is not None and self._replacement is not None:
                self._try_replacement(self._replacement, frame)
            elif frame is not None:
                outcome = self.path.run(frame)
                if isinstance(outcome, Rejected):
                    self._reject(outcome)
                self._announce_ready(frame_processed=isinstance(outcome, Processed))
            else:
                self._announce_ready(frame_processed=False)
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
            outcome = self._finish(self.path.run(frame), triggered=True, part_id=request.part_id)
            if isinstance(outcome, VerdictMessage):
                return outcome
            if isinstance(outcome, Rejected) and outcome.reason == "inference_error":
                return trigger.error(request.part_id, "inference_failed", outcome.detail)
        return trigger.error(request.part_id, "timeout", f"no frame captured after the request within {timeout_s:g} s")

    def handle(self, frame: Frame) -> None:
        """One frame through the running model."""
        self._finish(self.path.run(frame))

    def _finish(
        self, outcome: Processed | Rejected, *, triggered: bool = False, part_id: str | None = None
    ) -> VerdictMessage | Rejected | None:
        """A frame's outcome counted and published; a rejected frame is counted and logged.

        Returns the frame's verdict message (None without ``[inspect]`` or when not published), or
        the `Rejected`. A triggered frame is published whatever the outputs' ``publish_empty`` say.
        """
        if isinstance(outcome, Rejected):
            self._reject(outcome)
            return outcome
        self._inference_failures = 0
        frame, detections, times = outcome.frame, outcome.detections, outcome.times
        if detections.nonfinite:
            self.stats.drop("nonfinite_output")
            self._error_limited(
                "the model output %d NaN or infinite value(s) on frame %d, dropped (%d frame(s) so far): a NaN "
                "score never passes the threshold, so the model is broken or overflows on this input (check an "
                "fp16 export, and model.scale, mean and std); `edged check` runs it on a frame from the camera",
                detections.nonfinite,
                frame.frame_id,
                self.stats.drops["nonfinite_output"],
                frame=frame.frame_id,
                stage="decode",
            )
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
        if (record := self.path.verdict_record(outcome, part_id)) is not None:
            self.stats.record_verdict(record, outcome.verdict_ms)
        self.health.frame_done()
        payload, verdict = self._publish_detections(outcome, triggered=triggered, part_id=part_id)
        if self.evidence is not None:
            inspected = outcome.inspected
            self.evidence.offer(outcome.frame, detections, inspected.verdict if inspected else None, payload)
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

    def _publish_detections(
        self, done: Processed, *, triggered: bool, part_id: str | None
    ) -> tuple[bytes | None, VerdictMessage | None]:
        """To ZeroMQ and MQTT, each unless the frame found nothing and that output skips empty frames
        (a triggered frame always goes out), with its verdict message beside it; and the frame with
        its message to the live view when it wants one. Returns the payload and verdict published, if any."""
        found = len(done.detections) > 0 or triggered
        to_zmq = found or self.settings.publish.publish_empty
        mqtt = self.mqtt if self.mqtt is not None and (found or self.mqtt.cfg.publish_empty) else None
        show = self.http.view.wants_frame()
        if not (to_zmq or mqtt or show):
            return None, None
        state = self.report.state if self.report else "unknown"
        seq = next(self._seq["detections"]) if to_zmq or mqtt else 0  # a message only shown takes no seq
        msg = self.path.message(done, seq=seq, thermal_state=state, part_id=part_id)
        payload = verdict = None
        if to_zmq or mqtt:
            payload = msg.model_dump_json().encode()
            verdict = verdict_message(msg, next(self._seq["verdict"]))
            verdict_payload = verdict.model_dump_json().encode() if verdict else None
            prefix, camera = self.settings.publish.topic_prefix, self.settings.source.camera_id
            if to_zmq:
                self.publisher.send(detections_topic(prefix, camera), payload)
                if verdict_payload:
                    self.publisher.send(verdict_topic(prefix, camera), verdict_payload)
            if mqtt:
                mqtt.send("detections", payload)
                if verdict_payload:
                    mqtt.send("verdict", verdict_payload)
        if show:
            self.http.view.offer(done.frame, msg)
        return payload, verdict

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
            mqtt=self.mqtt.stats() if self.mqtt else None,
            evidence=self.evidence.report() if self.evidence else None,
        )

    def publish_status(self) -> None:
        self.stats.update_fps()
        self._update_rate_cap()
        snapshot = self.snapshot()
        message = snapshot.message(next(self._seq["status"]))
        topic = status_topic(self.settings.publish.topic_prefix, self.settings.source.camera_id)
        payload = message.model_dump_json().encode()
        self.publisher.send(topic, payload)
        if self.mqtt:
            self.mqtt.send("status", payload)
        self.http.update(message, self.stats.histograms(), self.stats.verdict_counts() if self.path.inspector else None)
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

    def health_problem(self) -> str | None:
        """Why the watchdog would not ping now, for ``/healthz``; None when it would."""
        return self.health.problem(self.capture.stats())

    def reload(self) -> None:
        """SIGHUP: load a new config and model; they take over once the model has run on a frame.

        A config or model that does not load is refused here; one that loads is tried on the next
        frame (`_try_replacement`), from the new source if the source changed, since a model can
        load and still fail on the camera's frames. A reload while another is on trial replaces it.
        """
        log.info("reloading configuration from %s", self.config_path)
        self.notifier.reloading()
        try:
            replacement = load_replacement(self.config_path, self.settings)
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
        reading = self._replacement.settings.source if self._replacement else self.settings.source
        if replacement.settings.source != reading:
            self._switch_capture(replacement.settings.source)
        self._replacement = replacement
        log.info("loaded model %s: trying it on the next frame", replacement.path.model.engine.identity.short)

    def _try_replacement(self, replacement: Replacement, frame: Frame) -> None:
        """Switch to a reload's model once it has run on ``frame``, or keep the running one.

        In free mode ``frame`` is then published like any other; in request mode nobody asked
        for it, so it is not (the warm-up before READY=1 is not either).
        """
        outcome = replacement.trial(frame)
        if isinstance(outcome, Rejected):  # the frame is unfit, not the model: the next frame decides
            self._reject(outcome)
            return
        self._replacement = None
        if isinstance(outcome, str):
            log.error(
                "reload refused, keeping the running configuration and model %s: the new model %s fails on frame %d: %s",
                self.model.engine.identity.short,
                replacement.path.model.engine.identity.short,
                frame.frame_id,
                outcome,
                extra={"FRAME": frame.frame_id, "STAGE": "reload"},
            )
            if replacement.settings.source == self.settings.source and self.trigger is None:
                self.handle(frame)
            else:
                self._switch_capture(self.settings.source)
            self.notifier.ready(self.snapshot().line())
            return
        new = replacement.settings
        old, self.settings = self.settings, new
        self.model, self.path = replacement.path.model, replacement.path
        self._switch_outputs(old, new)
        self.rate_cap = RateCap(new.service.max_fps)
        self.thermal = ThermalWatch(new.thermal) if new.thermal.enabled else None
        log.info("reloaded: model %s", self.model.engine.identity.short)
        self.notifier.ready(self.snapshot().line())
        if self.trigger is None:
            self._finish(outcome)

    def _switch_outputs(self, old: Settings, new: Settings) -> None:
        """A reload's camera id, ``[evidence]``, ``[mqtt]`` and ``[http]`` take effect with its model;
        the HTTP token is re-read."""
        self.publisher.follow_camera(new.source.camera_id)
        if (new.evidence, new.source.camera_id) != (old.evidence, old.source.camera_id):
            if self.evidence is not None:
                self.evidence.stop(timeout_s=EVIDENCE_STOP_S)
            self.evidence = self._start_evidence()
        if (new.mqtt, new.source.camera_id) != (old.mqtt, old.source.camera_id):
            if self.mqtt:
                self.mqtt.close()
            try:
                self.mqtt = self._start_mqtt()
                if self.mqtt and self.trigger:
                    self.trigger.attach(self.mqtt)
            except EdgedError as e:  # the password file went between the check and here
                self.mqtt = None
                log.error("MQTT output off until the next reload: %s", e)
        if new.http == old.http:
            self._reload_http_token()
            self.http.view.show_zones(new.inspect.zones if new.inspect else {})
            return
        try:
            http = self._http_server(new.http)
        except EdgedError as e:  # the token file went between the check and here
            log.error("live view settings not applied, the running server stays: %s", e)
            return
        self.http.close()  # the old server lets go of its address before the new one binds it
        self.http = http
        http.start()

    def _reload_http_token(self) -> None:
        try:
            self.http.reload_token()
        except KeyFileError as e:
            log.error("http token not reloaded, the previous one stays: %s", e)

    def _switch_capture(self, cfg: SourceBase) -> None:
        self.capture.stop()
        self.capture = self._start_capture(cfg)

    def shutdown(self, watchdog: Watchdog | None) -> None:
        self.notifier.stopping()
        if watchdog:
            watchdog.stop()
        self.capture.stop(timeout_s=CAPTURE_STOP_WAIT_S)
        if self.trigger is not None:
            self.trigger.close()
        if self.evidence is not None:
            self.evidence.stop(timeout_s=EVIDENCE_STOP_S)
        self.publish_status()
        self.publisher.close()
        self.http.close()
        if self.mqtt:
            self.mqtt.close()


def run(config_path: Path | None, settings: Settings) -> int:
    """``edged run``: returns the process exit code, or exits with it (`edged.service.exit_safely`).

    Every way out, a refused start included, stops the capture thread first; one still inside a
    camera call after its join is abandoned by exiting at once, never by interpreter finalisation.
    """
    notifier = Notifier()
    signals = Signals()
    signals.install()
    try:
        daemon = Daemon(settings, config_path, notifier, signals)
    except EdgedError as e:
        log.error("%s", e)
        notifier.status(f"refused to start: {e}" if e.exit_code == EXIT_CONFIG else f"cannot start: {e}")
        code = e.exit_code
    else:
        code = daemon.run()
    notifier.close()
    return exit_safely(code)
