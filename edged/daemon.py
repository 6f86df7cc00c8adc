"""The daemon: composes the cameras and the stages from the settings, runs the loop, stops cleanly.

Each camera (`edged.camera.Camera`) has its capture thread, its frame path on the one shared
model, its counters and sequence numbers. The loop hands the cameras' frames to the inference
lanes (`edged.lanes`) in turn: of those whose rate cap allows a frame, that are on no lane and
have one ready, the one served longest ago goes first, so a fast camera cannot starve a slow
one; it counts and publishes each result on its own thread, and with nothing to do waits for
any capture thread's hand-over, lane's result or request (`edged.wake`). A camera in request mode
(`edged.trigger`) takes a frame only for its request in hand, and goes first: the first frame it
captures after the request arrived answers it. Between frames it does the slow housekeeping:
thermal polls, status messages, the rate caps, config reloads. Each of those policies lives in
its own small module (`edged.ratecap`, `edged.health`, `edged.status`, `edged.reload`); this
one only wires them and turns the loop.
The HTTP server (`edged.http`) gets the status as it is published, a frame only when its live
view asks for one, and asks the health policy itself.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from edged.camera import Camera, camera_for, start_capture, stop_captures
from edged.capture import Capture
from edged.config import ProviderConfig, Settings
from edged.errors import EXIT_CONFIG, EXIT_FAILURE, EXIT_OK, ConfigError, EdgedError, KeyFileError, ModelError
from edged.evidence import EvidenceWriter
from edged.health import Health
from edged.http import HttpConfig, HttpServer
from edged.lanes import Lanes, Outcome
from edged.lograte import LogRate
from edged.messages import TriggerError, TriggerProblem, VerdictMessage
from edged.model import LoadedModel, load_model
from edged.mqtt import MqttOutput
from edged.pipeline import Processed, Rejected, camera_zones, frame_path, verdict_message
from edged.prometheus import CameraStatus
from edged.publish import Publisher, detections_topic, status_topic, verdict_topic
from edged.reload import Replacement, load_replacement
from edged.service import Notifier, Signals, Watchdog, exit_safely, watchdog_interval_s
from edged.sources import Frame
from edged.sources.base import SourceBase
from edged.status import Snapshot, summary_line
from edged.thermal import ThermalReport, ThermalWatch
from edged.trigger import Request, TriggerServer
from edged.wake import Wake

log = logging.getLogger(__name__)

TAKE_TIMEOUT_S = 0.25  # the loop comes round at least this often, frames or not
MAX_INFERENCE_FAILURES = 20  # consecutive failed runs before the daemon gives up
ERROR_LOG_INTERVAL_S = 10.0  # a burst of failing frames is one log line, then counters
# How long an exit waits for the capture threads to release their cameras, all of them together.
# A camera call that takes longer (an 8K JPEG decodes in seconds on a Pi) is abandoned: `run`
# then exits without finalising, which is safe, so this bounds the stop time rather than
# guarding the exit.
CAPTURE_STOP_WAIT_S = 1.0
LANES_STOP_WAIT_S = 5.0  # at stop, time left to the frames on the lanes to finish (one inference each)
EVIDENCE_STOP_S = 1.0  # at stop, time left to each evidence writer to finish its queue (a few ms per frame)


def same_source(a: SourceBase, b: SourceBase) -> bool:
    """The same camera opened the same way: a reload keeps its capture running (its
    `SourceBase.PROCESSING_KEYS` may differ, they do not touch the camera)."""
    return a.opening() == b.opening()


def requesting(settings: Settings) -> list[str]:
    """The cameras in request mode, in config order."""
    return [cfg.camera_id for cfg in settings.source if settings.trigger_mode(cfg) == "request"]


class Daemon:
    """One running configuration: model, cameras, publisher, thermal watch, and the loop."""

    def __init__(self, settings: Settings, config_path: Path | None, notifier: Notifier, signals: Signals) -> None:
        self.settings = settings
        self.config_path = config_path
        self.notifier = notifier
        self.signals = signals
        self.health = Health(settings.service.stall_timeout_s)
        self._wake = Wake()  # set by every capture thread's hand-over and every lane's result
        # The cameras open (or the scene pool is drawn) while the model loads: cold start pays
        # for the slower of the two, not their sum.
        captures = {cfg.camera_id: self._start_capture(cfg) for cfg in settings.source}
        try:
            self.model = model = load_model(settings.model, settings.runtime, lanes=settings.lanes())
            self.cameras = {
                cfg.camera_id: camera_for(settings, cfg, captures[cfg.camera_id], frame_path(settings, model, cfg))
                for cfg in settings.source
            }
            self.http = self._http_server(settings.http)
            self.publisher = Publisher(settings.publish, [cfg.camera_id for cfg in settings.source])
            self.mqtt = self._start_mqtt()
            self.trigger = self._start_trigger()
        except BaseException:
            stop_captures(captures.values(), CAPTURE_STOP_WAIT_S)
            raise
        self.http.start()
        self.lanes = Lanes(settings.lanes(), self._wake)
        for camera in self.cameras.values():
            camera.evidence = self._start_evidence(camera.cfg)
        self.thermal = ThermalWatch(settings.thermal) if settings.thermal.enabled else None
        self.report: ThermalReport | None = None
        self._inference_failures = 0
        self._error_log = LogRate(ERROR_LOG_INTERVAL_S)
        self._replacement: Replacement | None = None  # a reload on trial: it takes over on its first frame
        # During a trial, the cameras the reload adds or opens differently, served by its model only.
        self._incoming: dict[str, Camera] = {}
        self._next_status = self._next_thermal = time.monotonic()

    def _start_capture(self, cfg: SourceBase) -> Capture:
        return start_capture(cfg, self.settings.runtime.capture_priority, self._wake)

    def _http_server(self, cfg: HttpConfig) -> HttpServer:
        return HttpServer(cfg, self.health_problem, camera_zones(self.settings))

    def _start_mqtt(self) -> MqttOutput | None:
        cfg = self.settings.mqtt
        return MqttOutput(cfg, [source.camera_id for source in self.settings.source]) if cfg is not None else None

    def _start_evidence(self, cfg: SourceBase) -> EvidenceWriter | None:
        """The camera's evidence writer, when `Settings.evidence_for` gives it evidence settings."""
        evidence = self.settings.evidence_for(cfg)
        if evidence is None:
            return None
        writer = EvidenceWriter(evidence, cfg.camera_id)
        writer.start()
        return writer

    def _start_trigger(self) -> TriggerServer | None:
        cameras = requesting(self.settings)
        if not cameras:
            return None
        try:
            trigger = TriggerServer(self.settings.trigger, self.settings.publish, cameras, self.publisher.auth)
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
        self._quiesce()
        self.model = model
        for camera in self.cameras.values():
            camera.path = frame_path(self.settings, model, camera.cfg)

    def serving(self) -> list[Camera]:
        """The cameras the loop takes frames from: the running ones, and a reload's on trial in
        place of those it opens differently."""
        kept = [camera for name, camera in self.cameras.items() if name not in self._incoming]
        return kept + list(self._incoming.values())

    # ---- the loop ----------------------------------------------------------------------------

    def run(self) -> int:
        """Loop until stopped, every source ends or inference keeps failing; returns the exit code."""
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
                cameras = self.serving()
                fatal = next((c.capture.fatal for c in cameras if c.capture.fatal is not None), None)
                if fatal is not None:
                    return fatal.exit_code  # logged by the capture thread
                if all(camera.capture.state == "ended" for camera in cameras):
                    log.info("source ended: stopping" if len(cameras) == 1 else "every source ended: stopping")
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
        """Every turn of the loop: progress, thermal polls, status."""
        now = time.monotonic()
        self.health.loop_turned()
        if self.thermal and now >= self._next_thermal:
            self._poll_thermal(self.thermal)
            self._next_thermal = now + self.settings.thermal.poll_interval_s
        if now >= self._next_status:
            self.publish_status()
            self._next_status = now + self.settings.publish.status_interval_s

    def step(self) -> None:
        """Publish the lanes' results, take the requests that arrived, hand out the next frames; or
        wait for a frame, a result or a request."""
        self._wake.clear()  # cleared before looking: a hand-over, result or request after this ends the wait below
        settled = self._settle(self.lanes.collect())
        if self.trigger is not None:
            self._take_requests(self.trigger)
        if self._critical():
            self._quiesce()  # inference paused, status continues, requests are refused
            self._wait(TAKE_TIMEOUT_S)
            self.health.frame_done()
            return
        if self._hand_out() or settled:
            return
        self._wait(self._idle_s())
        if not self._settle(self.lanes.collect()) and not self._hand_out():
            self._announce_ready(frame_processed=False)

    def _critical(self) -> bool:
        """The board is critically hot: inference pauses until it cools (`edged.thermal`)."""
        return self.report is not None and self.report.rate_factor == 0.0

    def _on_trial(self, camera: Camera) -> bool:
        """A reload on trial takes this camera's next frame (`_try_replacement`)."""
        return self._replacement is not None and camera.id in self._replacement.paths

    def _wait(self, timeout_s: float) -> None:
        """Until a capture thread hands over a frame, a lane finishes one, a request arrives, or ``timeout_s``."""
        self._wake.wait(timeout_s, self.trigger.fds if self.trigger is not None else ())

    def _idle_s(self) -> float:
        """How long the loop may wait with nothing to do: until a rate cap lets a camera's frame
        be taken or a request's time is up, at most `TAKE_TIMEOUT_S`."""
        now, now_ns = time.monotonic(), time.monotonic_ns()
        waits = [TAKE_TIMEOUT_S]
        for camera in self.serving():
            if camera.request is not None and not self.lanes.carrying(camera):
                waits.append((self._deadline_ns(camera.request) - now_ns) / 1e9)
            elif not camera.due(now):
                waits.append(camera.wait_s(now))
        return max(0.0, min(waits))

    def _deadline_ns(self, request: Request) -> int:
        return request.arrived_ns + int(self.settings.trigger.timeout_s * 1e9)

    def _hand_out(self) -> int:
        """Hand idle lanes the frames of the cameras that want one, are on no lane and have a frame
        ready: those with a request in hand first, then the one served longest ago. Returns how
        many frames were taken.

        A camera in request mode passes over a frame captured before its request arrived (one
        waiting in the latest-frame slot, picamera2's queued one): its capture time, on the same
        monotonic clock as the arrival, says so. A reload on trial takes its cameras' next frame
        on this thread instead (`_try_replacement`).
        """
        taken = 0
        now = time.monotonic()
        for camera in sorted(self.serving(), key=lambda c: (c.request is None, c.served_s)):
            if not self.lanes.idle:
                break
            if self.lanes.carrying(camera) or not camera.due(now) or not self._wants_frame(camera):
                continue
            frame = camera.take()
            if frame is None:
                continue
            taken += 1
            if self._replacement is not None and self._on_trial(camera):
                self._try_replacement(self._replacement, camera, frame)
                return taken  # the cameras may have changed under this loop
            if camera.request is None or frame.t_capture_ns > camera.request.arrived_ns:
                self.lanes.submit(camera, frame)
        return taken

    def _wants_frame(self, camera: Camera) -> bool:
        """In free mode always; in request mode for its request in hand, a reload's trial, and
        before READY=1 (a frame through the model unpublished proves camera and model, and warms
        the session up)."""
        if camera.mode == "free" or camera.request is not None or not self.health.ready:
            return True
        return self._on_trial(camera)

    def _quiesce(self, timeout_s: float | None = None) -> None:
        """Let every frame on a lane finish, and publish it: before a camera's path or capture is
        replaced, since a lane may not share a path with anything."""
        self._settle(self.lanes.drain(timeout_s))

    def _settle(self, results: list[tuple[Camera, Outcome]]) -> int:
        """Count and publish the lanes' results, in the order they finished, answering the requests
        they were taken for; returns how many."""
        for camera, outcome in results:
            if camera.mode == "free":
                self._finish(camera, outcome)
            else:
                self._settle_request(camera, outcome)
        return len(results)

    def _settle_request(self, camera: Camera, outcome: Outcome) -> None:
        """A request-mode camera's result: its request's verdict, or why there is none; a frame it
        was not taken for (before READY=1) goes unpublished; an unfit frame leaves the request to
        the next frame."""
        request = camera.request
        if request is None or outcome.frame.t_capture_ns <= request.arrived_ns:
            if isinstance(outcome, Rejected):
                self._reject(camera, outcome)
            else:
                self._announce_ready(frame_processed=True, camera=camera)
            return
        verdict = self._finish(camera, outcome, triggered=True, part_id=request.part_id)
        if isinstance(verdict, VerdictMessage):
            self._reply(camera, verdict)
        elif isinstance(verdict, Rejected) and verdict.reason == "inference_error":
            self._reply(camera, self._refusal(camera, "inference_failed", verdict.detail))

    def _take_requests(self, trigger: TriggerServer) -> None:
        """Read the requests that arrived; give each request-mode camera without one its next, and
        answer at once those that cannot be served (thermal critical, the camera lost, time up).

        A camera with a frame on a lane keeps its request: that frame's result answers it. Waiting
        for requests is progress in this mode (`edged.health`)."""
        trigger.collect()
        now_ns = time.monotonic_ns()
        idle = False
        for camera in self.serving():
            if camera.mode != "request":
                continue
            while not self.lanes.carrying(camera):
                if camera.request is None:
                    camera.request = trigger.next(camera.id)
                if camera.request is None:
                    idle = True
                    break
                problem = self._unanswerable(camera, now_ns)
                if problem is None:
                    break
                self._reply(camera, self._refusal(camera, *problem))
        if idle:
            self.health.frame_done()

    def _unanswerable(self, camera: Camera, now_ns: int) -> tuple[TriggerProblem, str] | None:
        """Why ``camera``'s request in hand gets no verdict, or None while one may still come."""
        assert camera.request is not None
        if self._critical():
            return "thermal_critical", "inference is paused until the board cools"
        capture = camera.capture.stats()
        if capture.state in ("lost", "ended"):
            why = f": {capture.last_error}" if capture.last_error else ""
            return "camera_lost", f"the camera is {capture.state}{why}"
        if now_ns >= self._deadline_ns(camera.request):
            return "timeout", f"no frame captured after the request within {self.settings.trigger.timeout_s:g} s"
        return None

    def _refusal(self, camera: Camera, problem: TriggerProblem, detail: str) -> TriggerError:
        assert self.trigger is not None and camera.request is not None
        return self.trigger.error(camera.request, problem, detail)

    def _reply(self, camera: Camera, reply: VerdictMessage | TriggerError) -> None:
        """Answer ``camera``'s request in hand; it may take the next."""
        assert self.trigger is not None and camera.request is not None
        self.trigger.answer(camera.request, reply)
        camera.request = None

    def handle(self, camera: Camera, frame: Frame) -> None:
        """One frame of ``camera`` through the running model."""
        self._finish(camera, camera.path.run(frame))

    def _finish(
        self, camera: Camera, outcome: Processed | Rejected, *, triggered: bool = False, part_id: str | None = None
    ) -> VerdictMessage | Rejected | None:
        """A frame's outcome counted and published; a rejected frame is counted and logged.

        Returns the frame's verdict message (None without ``[inspect]`` or when not published), or
        the `Rejected`. A triggered frame is published whatever the outputs' ``publish_empty`` say.
        """
        if isinstance(outcome, Rejected):
            self._reject(camera, outcome)
            return outcome
        self._inference_failures = 0
        frame, detections, times, stats = outcome.frame, outcome.detections, outcome.times, camera.stats
        if detections.nonfinite:
            stats.drop("nonfinite_output")
            self._error_limited(
                "camera %s: the model output %d NaN or infinite value(s) on frame %d, dropped (%d frame(s) so far): "
                "a NaN score never passes the threshold, so the model is broken or overflows on this input (check an "
                "fp16 export, and model.scale, mean and std); `edged check` runs it on a frame from the camera",
                camera.id,
                detections.nonfinite,
                frame.frame_id,
                stats.drops["nonfinite_output"],
                camera=camera.id,
                frame=frame.frame_id,
                stage="decode",
            )
        if detections.scores_above_one:
            stats.drop("score_above_one")
            self._error_limited(
                "camera %s: the model gave %d score(s) above 1 on frame %d, dropped (%d frame(s) so far): scores "
                "must be probabilities, so check model.scale, mean and std against how the model was trained, "
                "and that its head ends in a sigmoid",
                camera.id,
                detections.scores_above_one,
                frame.frame_id,
                stats.drops["score_above_one"],
                camera=camera.id,
                frame=frame.frame_id,
                stage="decode",
            )
        stats.record(times.preprocess_ms, times.inference_ms, times.decode_ms, outcome.age_ms)
        if (record := camera.path.verdict_record(outcome, part_id)) is not None:
            stats.record_verdict(record, outcome.verdict_ms)
        self.health.frame_done()
        payload, verdict = self._publish_detections(camera, outcome, triggered=triggered, part_id=part_id)
        if camera.evidence is not None:
            inspected = outcome.inspected
            camera.evidence.offer(outcome.frame, detections, inspected.verdict if inspected else None, payload)
        self._announce_ready(frame_processed=True, camera=camera)
        return verdict

    def _reject(self, camera: Camera, rejected: Rejected) -> None:
        camera.stats.drop(rejected.reason)
        count, frame_id = camera.stats.drops[rejected.reason], rejected.frame.frame_id
        if rejected.reason == "inference_error":
            self._inference_failures += 1
            self._error_limited(
                "camera %s: inference failed, frame %d skipped (%d failed so far): %s",
                camera.id,
                frame_id,
                count,
                rejected.detail,
                camera=camera.id,
                frame=frame_id,
                stage="inference",
            )
        elif count == 1:
            log.warning(
                "camera %s: frame %d rejected (%s): %s",
                camera.id,
                frame_id,
                rejected.reason.removeprefix("bad_frame_"),
                rejected.detail,
                extra={"CAMERA": camera.id, "FRAME": frame_id, "STAGE": "contract"},
            )

    def _error_limited(self, message: str, *args: object, camera: str, frame: int, stage: str) -> None:
        """Log a per-frame error at most once per ERROR_LOG_INTERVAL_S; the counters carry the rest."""
        if self._error_log.allows():
            log.error(message, *args, extra={"CAMERA": camera, "FRAME": frame, "STAGE": stage})

    def _announce_ready(self, *, frame_processed: bool, camera: Camera | None = None) -> None:
        """READY=1 on the first frame of any camera, or once a camera is known to be lost (`edged.health`)."""
        lost = any(c.capture.state == "lost" for c in self.cameras.values())
        if self.health.should_announce(frame_processed=frame_processed, capture_state="lost" if lost else "starting"):
            self.notifier.ready(self.status_line())
            if camera is not None:
                log.info("first frame processed: ready", extra={"CAMERA": camera.id})

    # ---- messages ----------------------------------------------------------------------------

    def _publish_detections(
        self, camera: Camera, done: Processed, *, triggered: bool, part_id: str | None
    ) -> tuple[bytes | None, VerdictMessage | None]:
        """To ZeroMQ and MQTT, each unless the frame found nothing and that output skips empty frames
        (a triggered frame always goes out), with its verdict message beside it; and the frame with
        its message to the camera's live view when someone watches it and it wants a frame. Returns
        the payload and verdict published, if any."""
        found = len(done.detections) > 0 or triggered
        to_zmq = found or self.settings.publish.publish_empty
        mqtt = self.mqtt if self.mqtt is not None and (found or self.mqtt.cfg.publish_empty) else None
        show = self.http.wants_frame(camera.id)
        if not (to_zmq or mqtt or show):
            return None, None
        state = self.report.state if self.report else "unknown"
        seq = camera.next_seq("detections") if to_zmq or mqtt else 0  # a message only shown takes no seq
        msg = camera.path.message(done, seq=seq, thermal_state=state, part_id=part_id)
        payload = verdict = None
        if to_zmq or mqtt:
            payload = msg.model_dump_json().encode()
            verdict = verdict_message(msg, camera.next_seq("verdict")) if msg.verdict is not None else None
            verdict_payload = verdict.model_dump_json().encode() if verdict else None
            prefix = self.settings.publish.topic_prefix
            if to_zmq:
                self.publisher.send(detections_topic(prefix, camera.id), payload)
                if verdict_payload:
                    self.publisher.send(verdict_topic(prefix, camera.id), verdict_payload)
            if mqtt:
                mqtt.send("detections", payload, camera.id)
                if verdict_payload:
                    mqtt.send("verdict", verdict_payload, camera.id)
        if show:
            self.http.offer(camera.id, done.frame, msg)
        return payload, verdict

    def snapshot(self, camera: Camera) -> Snapshot:
        return Snapshot(
            camera_id=camera.id,
            stats=camera.stats,
            capture=camera.capture.stats(),
            publish_drops=self.publisher.drops,
            rate_cap_fps=camera.rate_cap.fps,
            thermal=self.report,
            model=self.model.info,
            model_short=self.model.engine.identity.short,
            mqtt=self.mqtt.stats() if self.mqtt else None,
            evidence=camera.evidence.report() if camera.evidence else None,
        )

    def status_line(self) -> str:
        """systemd's STATUS=: every camera's rate and state (`edged.status.summary_line`)."""
        return summary_line([self.snapshot(camera) for camera in self.serving()])

    def publish_status(self) -> None:
        """Each camera's status message on its topic, all of them to the HTTP server, the summary to systemd."""
        self._update_rate_caps()
        snapshots = []
        statuses: list[CameraStatus] = []
        for camera in self.serving():
            camera.stats.update_fps()
            snapshot = self.snapshot(camera)
            snapshots.append(snapshot)
            message = snapshot.message(camera.next_seq("status"))
            payload = message.model_dump_json().encode()
            self.publisher.send(status_topic(self.settings.publish.topic_prefix, camera.id), payload)
            if self.mqtt:
                self.mqtt.send("status", payload, camera.id)
            verdicts = camera.stats.verdict_counts() if camera.path.inspector else None
            statuses.append((message, camera.stats.histograms(), verdicts))
        self.http.update(statuses)
        self.notifier.status(summary_line(snapshots))

    # ---- housekeeping ------------------------------------------------------------------------

    def _poll_thermal(self, thermal: ThermalWatch) -> None:
        previous = self.report.state if self.report else None
        self.report = thermal.poll()
        if previous is not None and previous != self.report.state:
            self._update_rate_caps()
            self.notifier.status(self.status_line())

    def _update_rate_caps(self) -> None:
        """Free cameras' caps follow the thermal state; in request mode the requests set the pace."""
        for camera in self.serving():
            if camera.mode == "free":
                camera.update_rate_cap(self.report.rate_factor if self.report else 1.0)

    def _fall_back_provider(self) -> bool:
        """Drop the provider that keeps failing and carry on with the next one in the list."""
        providers = self.model.engine.providers
        if len(providers) < 2:
            return False
        remaining = [ProviderConfig(name=name, options=options) for name, options in providers[1:]]
        runtime = self.settings.runtime.model_copy(update={"providers": remaining})
        try:
            model = load_model(self.settings.model, runtime, lanes=self.settings.lanes())
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
        """Progress for the watchdog (`edged.health`): the loop turns and some camera progresses."""
        return self.health_problem() is None

    def health_problem(self) -> str | None:
        """Why the watchdog would not ping now, for ``/healthz``; None when it would."""
        cameras = {camera.id: camera.capture.stats() for camera in self.serving()}
        return self.health.problem(cameras, self.lanes.inferring())

    # ---- reloads -----------------------------------------------------------------------------

    def reload(self) -> None:
        """SIGHUP: load a new config and model; they take over once the model has run on a frame.

        A config or model that does not load is refused here; one that loads is tried on the next
        frame from one of its cameras (`_try_replacement`), since a model can load and still fail
        on the cameras' frames. Cameras it adds or opens differently start now and are served by
        the new model only; a camera it opens differently is closed first (a device opens once);
        cameras it removes keep running on the old model until the switch. A reload while
        another is on trial replaces it.
        """
        log.info("reloading configuration from %s", self.config_path)
        self.notifier.reloading()
        try:
            replacement = load_replacement(self.config_path, self.settings)
            self._check_servable(replacement.settings)
        except EdgedError as e:
            log.error("reload refused, keeping the running configuration: %s", e)
            self.notifier.ready(self.status_line())
            return
        try:
            self.publisher.reload_client_keys()  # the trigger server's too: it shares the publisher's
        except KeyFileError as e:
            log.error("subscriber keys not reloaded, the previous allow-list stays: %s", e)
        self._end_trial()  # which lets the frames on the lanes finish first
        self._replacement = replacement
        for cfg in replacement.settings.source:
            running = self.cameras.get(cfg.camera_id)
            if running is not None and same_source(running.cfg, cfg):
                continue
            if running is not None:
                running.capture.stop()
            capture = self._start_capture(cfg)
            path = replacement.paths[cfg.camera_id]
            self._incoming[cfg.camera_id] = camera_for(replacement.settings, cfg, capture, path, running)
        log.info("loaded model %s: trying it on the next frame", replacement.model.engine.identity.short)

    def _check_servable(self, new: Settings) -> None:
        """Refuse (`ConfigError`) a reload that turns request mode on or off: the request socket is
        bound at start, as the trigger settings say. Cameras may move between the modes while
        some camera stays in request mode."""
        if bool(requesting(new)) != (self.trigger is not None):
            problem = "the reload turns request mode on or off (no camera took requests, or none would): restart edged"
            raise ConfigError(self.config_path, [problem])

    def _end_trial(self) -> None:
        """Back to the running cameras only: those a trial opened are closed, those it closed reopened."""
        self._quiesce()
        self._replacement = None
        incoming, self._incoming = self._incoming, {}
        stop_captures([camera.capture for camera in incoming.values()], CAPTURE_STOP_WAIT_S)
        for name, trial in incoming.items():
            running = self.cameras.get(name)
            if running is not None:  # the trial camera hands back what it took over, its request included
                capture = self._start_capture(running.cfg)
                self.cameras[name] = camera_for(self.settings, running.cfg, capture, running.path, trial)

    def _try_replacement(self, replacement: Replacement, camera: Camera, frame: Frame) -> None:
        """Switch to a reload's model once it has run on ``frame``, or keep the running one.

        In free mode ``frame`` is then published like any other; in request mode nobody asked
        for it, so it is not (the warm-up before READY=1 is not either).
        """
        outcome = replacement.trial(camera.id, frame)
        if isinstance(outcome, Rejected):  # the frame is unfit, not the model: the next frame decides
            self._reject(camera, outcome)
            return
        if isinstance(outcome, str):
            log.error(
                "reload refused, keeping the running configuration and model %s: the new model %s fails on "
                "frame %d of camera %s: %s",
                self.model.engine.identity.short,
                replacement.model.engine.identity.short,
                frame.frame_id,
                camera.id,
                outcome,
                extra={"CAMERA": camera.id, "FRAME": frame.frame_id, "STAGE": "reload"},
            )
            trial_camera = camera.id in self._incoming
            self._end_trial()
            if not trial_camera and camera.mode == "free":
                self.handle(camera, frame)
            self.notifier.ready(self.status_line())
            return
        self._switch(replacement)
        log.info("reloaded: model %s", self.model.engine.identity.short)
        self.notifier.ready(self.status_line())
        switched = self.cameras[camera.id]
        if switched.mode == "free":  # in request mode nobody asked for the trial frame: it is not published
            self._finish(switched, outcome)

    def _switch(self, replacement: Replacement) -> None:
        """The reload takes over: its model, cameras, outputs and thermal watch."""
        self._quiesce()
        self.lanes.close()
        self.lanes = Lanes(replacement.settings.lanes(), self._wake)
        new = replacement.settings
        old, self.settings = self.settings, new
        self.model = replacement.model
        cameras = {}
        for cfg in new.source:
            incoming = self._incoming.get(cfg.camera_id)
            if incoming is None:  # a running camera the reload opens the same way keeps its capture
                running = self.cameras[cfg.camera_id]
                incoming = camera_for(new, cfg, running.capture, replacement.paths[cfg.camera_id], running)
            cameras[cfg.camera_id] = incoming
        removed = [camera for name, camera in self.cameras.items() if name not in cameras]
        for camera in removed:
            log.info("camera %s removed", camera.id, extra={"CAMERA": camera.id})
        stop_captures([camera.capture for camera in removed], CAPTURE_STOP_WAIT_S)
        for name in cameras.keys() - self.cameras.keys():
            log.info("camera %s added", name, extra={"CAMERA": name})
        for camera in self.cameras.values():  # its request stayed behind: removed, or now free-running
            if camera.request is not None:
                self._reply(camera, self._refusal(camera, "bad_request", f"camera {camera.id} no longer takes requests"))
        self._switch_evidence(old, cameras, removed)
        self.cameras, self._incoming, self._replacement = cameras, {}, None
        self._switch_outputs(old, new)
        self.thermal = ThermalWatch(new.thermal) if new.thermal.enabled else None

    def _switch_evidence(self, old: Settings, cameras: dict[str, Camera], removed: list[Camera]) -> None:
        """A reload's ``[evidence]``, and each camera's ``evidence`` key or table, take effect with its model."""
        for camera in removed:
            if camera.evidence is not None:
                camera.evidence.stop(timeout_s=EVIDENCE_STOP_S)
        for camera in cameras.values():
            running = self.cameras.get(camera.id)
            if running is not None and old.evidence_for(running.cfg) == self.settings.evidence_for(camera.cfg):
                continue  # the same writer carries on (a camera takes over its predecessor's)
            if camera.evidence is not None:
                camera.evidence.stop(timeout_s=EVIDENCE_STOP_S)
            camera.evidence = self._start_evidence(camera.cfg)

    def _switch_outputs(self, old: Settings, new: Settings) -> None:
        """A reload's cameras (their topics), ``[mqtt]`` and ``[http]`` take effect with its model; the
        HTTP token is re-read."""
        self.publisher.follow_cameras([c.camera_id for c in new.source])
        if self.trigger is not None:
            self.trigger.follow_cameras(requesting(new))
        if (new.mqtt, [c.camera_id for c in new.source]) != (old.mqtt, [c.camera_id for c in old.source]):
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
            self.http.follow_cameras(camera_zones(new))
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

    def shutdown(self, watchdog: Watchdog | None) -> None:
        self.notifier.stopping()
        if watchdog:
            watchdog.stop()
        while True:  # each lane's error is raised alone; the results beside them are still published
            try:
                self._quiesce(LANES_STOP_WAIT_S)
                break
            except ModelError as e:  # another lane's frame failed as the first did: said, and stopping anyway
                log.error("%s", e)
        self.lanes.close()
        captures = [camera.capture for camera in self.cameras.values()]
        stop_captures(captures + [camera.capture for camera in self._incoming.values()], CAPTURE_STOP_WAIT_S)
        if self.trigger is not None:
            self.trigger.close()
        for camera in self.cameras.values():
            if camera.evidence is not None:
                camera.evidence.stop(timeout_s=EVIDENCE_STOP_S)
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
