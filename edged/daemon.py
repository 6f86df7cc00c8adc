"""The daemon: composes the cameras, the model and the outputs from the settings, turns the loop, stops cleanly.

The loop hands the cameras' frames (`edged.camera`) to the inference lanes (`edged.lanes`) in the order
`edged.schedule` says, counts each result and hands it to the outputs (`edged.outputs`), answering requests
(`edged.requests`); with nothing to do it waits for a hand-over, a result or a request (`edged.wake`). Between
frames: thermal polls, status (`edged.status`), rate caps, reloads (`edged.reload.Trial`), and in time it
would spend waiting a candidate model's trial (`edged.candidate`). The watchdog and ``/healthz`` read what the
loop publishes to them (`edged.health.Watched`), never its own state.
"""

from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path
from typing import Any

from edged.camera import Camera, camera_for, say_ended, start_capture, stop_captures
from edged.candidate import Candidate
from edged.capture import Capture
from edged.config import Settings
from edged.errors import EXIT_CONFIG, EXIT_FAILURE, EXIT_OK, ConfigError, ContractError, KeyFileError, ModelError
from edged.health import Health, Watched
from edged.journal import JournalOutput
from edged.lanes import Lanes, Outcome
from edged.lograte import LogRate
from edged.messages import VerdictMessage
from edged.model import load_model
from edged.output import Services
from edged.outputs import Outputs
from edged.pipeline import Rejected, frame_path
from edged.reload import CAPTURE_STOP_WAIT_S, Fallback, Reloads, Trial, changes, give_back_freed_memory
from edged.requests import RequestDesk
from edged.schedule import hand_out, idle_s, pause
from edged.service import Notifier, Signals, Watchdog, watchdog_interval_s
from edged.settings.sources import SourceBase
from edged.shadow import Swap
from edged.sources.base import Frame
from edged.status import publish_status, snapshot, summary_line
from edged.thermal import ThermalReport, ThermalWatch, reloaded_watch
from edged.trigger import Request
from edged.wake import Wake

log = logging.getLogger(__name__)

TAKE_TIMEOUT_S = 0.25  # the loop comes round at least this often, frames or not
MAX_INFERENCE_FAILURES = 20  # consecutive failed runs before the daemon gives up
ERROR_LOG_INTERVAL_S = 10.0  # a burst of failing frames is one log line, then counters
LANES_STOP_WAIT_S = 2.0  # at stop, time left to the frames on the lanes to finish (one inference each)
LANES_RELOAD_WAIT_S = 1.0  # a reload's wait for the frames on the lanes; a hung one stays there, its camera idle


class Daemon:
    """One running configuration: model, cameras, outputs, request desk, thermal watch, and the loop.

    Everything it opens is closed through one `contextlib.ExitStack`, in reverse order: what a failed start opened, or all.
    """

    def __init__(self, settings: Settings, config_path: Path | None, notifier: Notifier, signals: Signals) -> None:
        self.settings = settings
        self.config_path = config_path
        self.notifier = notifier
        self.signals = signals
        self.health = Health(settings.service.stall_timeout_s)
        self._wake = signals.wake = Wake()  # set by each capture thread's hand-over, lane's result and signal
        self.cameras: dict[str, Camera] = {}
        self._trial: Trial | None = None  # a reload on trial: it takes over on its first frame
        self._started = False
        with contextlib.ExitStack() as stack:
            stack.callback(self._wake.close)
            stack.callback(lambda: None if self._trial is None else self._trial.replacement.give_up())  # a trial's folders
            # The cameras open (or the scene pool is drawn) while the model loads: cold start pays the slower, not the sum.
            captures = {cfg.camera_id: self._start_capture(cfg) for cfg in settings.source}
            stack.callback(lambda: stop_captures(self._captures() or captures.values(), CAPTURE_STOP_WAIT_S))
            self.model = signals.unless_stopped(load_model, settings.model, settings.runtime, lanes=settings.lanes())
            self.cameras = {
                cfg.camera_id: camera_for(settings, cfg, captures[cfg.camera_id], frame_path(settings, self.model, cfg))
                for cfg in settings.source
            }
            if problem := JournalOutput.in_use(settings):
                raise ConfigError(None, [problem])
            self.outputs = Outputs(settings, Services(self.health.current_problem, self._wake))
            stack.callback(self.outputs.close)
            self.desk = RequestDesk(settings, self.outputs) if settings.requesting() else None
            if self.desk is not None:
                stack.callback(self.desk.close)
            stack.callback(lambda: self.publish_status())  # at stop, once the evidence is written
            stack.callback(self.outputs.drain)
            self.lanes = Lanes(settings.lanes(), self._wake)
            stack.callback(self.lanes.close)
            self.candidate = Candidate(settings, self.model)
            stack.callback(self.candidate.close)
            stack.callback(self._finish_lanes)
            self._resources = stack.pop_all()
        self._started = True
        self._reloads = Reloads(
            config_path, self._wake, notifier.reloading, requests=self.desk is not None, trial_for=self.candidate.trial_for
        )
        self.thermal = ThermalWatch(settings.thermal) if settings.thermal.enabled else None
        self.report: ThermalReport | None = None
        self._inference_failures = 0
        self._errors = LogRate(ERROR_LOG_INTERVAL_S)  # a burst of failing frames is one log line
        self._next_status = self._next_thermal = time.monotonic()
        self._watch()

    def _start_capture(self, cfg: SourceBase) -> Capture:
        return start_capture(cfg, self.settings.runtime.capture_priority, self._wake)

    def _captures(self) -> list[Capture]:
        return [c.capture for c in [*self.cameras.values(), *(self._trial.incoming.values() if self._trial else ())]]

    def serving(self) -> list[Camera]:
        """The cameras the loop takes frames from (during a reload's trial, `Trial.serving`)."""
        return self._trial.serving(self.cameras) if self._trial else list(self.cameras.values())

    def _watch(self) -> None:
        """Publish the cameras served and the lanes to the watchdog and ``/healthz`` (`edged.health.Watched`)."""
        self.health.watch(Watched(tuple((c.id, c.capture) for c in self.serving()), self.lanes.inferring))

    # ---- the loop ----------------------------------------------------------------------------

    def run(self) -> int:
        """Loop until stopped, every source ends or inference keeps failing; returns the exit code."""
        interval = watchdog_interval_s()
        watchdog = Watchdog(self.notifier, interval, self.health.current_problem) if interval else None
        if watchdog:
            watchdog.start()
        try:
            while not self.signals.stop.is_set():
                self._reload()
                self.housekeeping()
                code = self._exit_code()
                if code is not None:
                    return code
                self.step()
        except (ContractError, ModelError) as e:  # the model cannot run on this camera's frames at all
            log.error("%s", e)
            return EXIT_CONFIG
        finally:
            self.notifier.stopping()
            if watchdog:
                watchdog.stop()
            self._resources.close()
        return EXIT_OK

    def _exit_code(self) -> int | None:
        """Why the loop ends now, if it does: a capture thread's fatal error, every source ended, or
        inference failing frame after frame, no fallback to the next provider loading nor left (`_fall_back_provider`)."""
        cameras = self.serving()
        fatal = next((c.capture.fatal for c in cameras if c.capture.fatal is not None), None)
        if fatal is not None:
            return fatal.exit_code  # logged by the capture thread
        if all(camera.capture.state == "ended" for camera in cameras):
            self._finish_lanes()  # their last frames published and counted before they are said
            say_ended(cameras)
            return EXIT_OK
        if self._inference_failures >= MAX_INFERENCE_FAILURES and not self._fall_back_provider():
            log.error(
                "inference failed on %d frames in a row: stopping so that systemd restarts "
                "edged (check the model and the execution provider)",
                self._inference_failures,
            )
            return EXIT_FAILURE
        return None

    def housekeeping(self) -> None:
        """Every turn of the loop: progress, thermal polls, status."""
        now = time.monotonic()
        self.health.loop_turned()
        if self.thermal and now >= self._next_thermal:
            previous = self.report.state if self.report else None
            self.report = self.thermal.poll()
            self._next_thermal = now + self.settings.thermal.poll_interval_s
            if previous is not None and previous != self.report.state:
                self._update_rate_caps()
                self.notifier.status(self.status_line())
        if now >= self._next_status:
            self.publish_status()
            self._next_status = now + self.settings.publish.status_interval_s

    def step(self) -> None:
        """Publish the lanes' results, take the requests, hand out the next frames; or wait for any of them."""
        self._wake.clear()  # cleared before looking: a hand-over, result or request after this ends the wait below
        self.outputs.deliver_recorded()  # verdicts the journal has recorded since the last turn go out
        blocked = "a reload is loading" if self._reloads.loading else "a reload is on trial" if self._trial else None
        self.candidate.serve(self._live, self._swap, blocked, self.outputs.get(JournalOutput))
        settled = self._settle(self.lanes.collect())
        if self.desk is not None and self.desk.take(self.serving(), self.lanes.carrying, self._critical()):
            self.health.frame_done()  # waiting for requests is progress in request mode
        if self._critical():  # inference paused, status continues, requests are refused
            pause(self.serving())
            self._wake.wait(TAKE_TIMEOUT_S, self._fds())  # a result on a lane wakes it, for the next turn's collect
            self.health.frame_done()
            return
        if self._hand_out() or settled:
            return
        if self.lanes.idle == self.lanes.count and self.candidate.run(self.serving(), self.desk):
            return  # the candidate took the time the loop would have waited
        self._wake.wait(idle_s(self.serving(), self.desk, self.lanes.carrying, TAKE_TIMEOUT_S), self._fds())
        if not self._settle(self.lanes.collect()) and not self._hand_out():
            self._announce_ready(frame_processed=False)

    def _critical(self) -> bool:
        """The board is critically hot: inference pauses until it cools (`edged.thermal`)."""
        return self.report is not None and self.report.rate_factor == 0.0

    def _fds(self) -> list[Any]:
        return (self.desk.fds if self.desk is not None else []) + self.candidate.fds

    def _hand_out(self) -> int:
        """Hand idle lanes the next frames (`edged.schedule.hand_out`); a reload's trial runs its own here (`_try`)."""
        cameras, ready = self.serving(), self.health.ready
        return hand_out(
            cameras, self.lanes, self.desk, self.outputs, ready=ready, on_trial=self._on_trial, try_frame=self._try
        )

    def _on_trial(self, camera: Camera) -> bool:
        return self._trial is not None and self._trial.takes(camera)

    def _settle(self, results: list[tuple[Camera, Outcome]]) -> int:
        """Count and publish the lanes' results, in the order they finished, answering the requests
        they were taken for; a request-mode camera's frame taken for none (before READY=1) goes
        unpublished, and an unfit frame leaves its request to the next. Returns how many."""
        for camera, outcome in results:
            request = self.desk.answers(camera, outcome.frame.t_capture_ns) if self.desk else None
            if camera.mode == "free":
                self._finish(camera, outcome)
            elif request is None or self.desk is None:
                self._finish(camera, outcome, publish=False)
            elif isinstance(verdict := self._finish(camera, outcome, request=request), VerdictMessage):
                self.desk.answer(request, verdict)
            elif isinstance(verdict, Rejected) and verdict.reason == "inference_error":
                self.desk.refuse(request, "inference_failed", verdict.detail)
        return len(results)

    def _finish(
        self, camera: Camera, outcome: Outcome, *, request: Request | None = None, publish: bool = True
    ) -> VerdictMessage | Rejected | None:
        """A frame's outcome counted and handed to the outputs, or, rejected, counted and logged; returns
        the verdict message sent (None without ``[inspect]`` or when not sent) or the `Rejected`."""
        if isinstance(outcome, Rejected):
            self._inference_failures += camera.reject(outcome, self._errors)
            return outcome
        verdict = None
        if publish:
            self._inference_failures = 0
            camera.record(outcome, request.part_id if request else None, self._errors)
            self.health.frame_done()
            verdict = self.outputs.publish(camera, outcome, request, self.report.state if self.report else "unknown")
            self.candidate.observe(camera.id, outcome)
        self._announce_ready(frame_processed=True, camera=camera)
        return verdict

    def _announce_ready(self, *, frame_processed: bool, camera: Camera | None = None) -> None:
        """READY=1 on the first frame of any camera, or once a camera is known to be lost (`edged.health`)."""
        if self.health.ready:
            return
        lost = any(c.capture.state == "lost" for c in self.cameras.values())
        if self.health.should_announce(frame_processed=frame_processed, capture_state="lost" if lost else "starting"):
            self.notifier.ready(self.status_line())
            if camera is not None:
                log.info("first frame processed: ready", extra={"CAMERA": camera.id})

    def status_line(self) -> str:
        """systemd's STATUS=: every camera's rate and state, and what withholds the pings (`edged.status.summary_line`)."""
        candidate = self.candidate.report()
        snapshots = [snapshot(c, self.report, self.model, self.outputs, candidate) for c in self.serving()]
        return summary_line(snapshots, self.health.current_problem())

    def publish_status(self) -> None:
        """Each camera's status message to every output, the summary to systemd; none from a start that failed."""
        if not self._started:  # the stack closing a failed start: it served nothing, and made not all a status reads
            return
        self._update_rate_caps()
        snapshots = publish_status(self.serving(), self.report, self.model, self.outputs, self.candidate.report())
        self.notifier.status(summary_line(snapshots, self.health.current_problem()))

    def _update_rate_caps(self) -> None:
        """Free cameras' caps follow the thermal state; in request mode the requests set the pace."""
        for camera in self.serving():
            if camera.mode == "free":
                camera.update_rate_cap(self.report.rate_factor if self.report else 1.0)

    def _fall_back_provider(self) -> bool:
        """Whether to go on with inference failing: a fallback loads off this thread (`edged.reload.Reloads.fall_back`),
        which is progress to the watchdog, as frames are, until the load counts as stuck and this says no."""
        sources, failures = [camera.cfg for camera in self.cameras.values()], self._inference_failures
        if going_on := self._reloads.fall_back(self.settings, self.model, sources, failures, self.candidate.follower):
            self.health.frame_done()
        return going_on

    def _live(self) -> Swap:
        """The model serving now and each camera's path through it: what a promotion keeps for rollback."""
        return Swap(self.model, {camera.id: camera.path for camera in self.cameras.values()})

    def _swap(self, swap: Swap) -> None:
        """A promotion, a rollback or a provider fallback takes over between frames, and STATUS= says
        so: the frames on the lanes are published first (`_switch` says why one may outlast the wait)."""
        self._settle(self.lanes.drain(LANES_RELOAD_WAIT_S))
        self.model = swap.model
        for camera in self.cameras.values():
            camera.path = swap.paths.get(camera.id, camera.path)
        self.notifier.status(self.status_line())

    def _reload(self) -> None:
        """SIGHUP (`edged.reload.Reloads`): one loaded is tried on the next frame from one of its cameras (`_try`),
        since a model can load and still fail on them (`edged.reload.Trial`); one that did not is refused. A reload
        replaces one on trial, and one that closed a running camera gives way once a newer loads: it serves meanwhile.
        A provider fallback loaded takes over as a promotion does, the candidate following, unless its model was replaced."""
        replacement = self._reloads.take(self.signals.reload, self.settings)
        if isinstance(replacement, Fallback):
            if self._reloads.takes_over(replacement, self.model):
                self._swap(replacement.swap)  # the frames on the lanes ran on the failing provider: counted first
                self.settings, self._inference_failures = replacement.settings, 0
                self.candidate.fell_back(replacement.candidate, replacement.swap)
                give_back_freed_memory()  # the failing models' sessions, freed as they were swapped out
            return
        if self._trial is not None and self._trial.reopens and self._reloads.loading:
            log.info("the reload on trial gives way to a newer one, loading: the running cameras serve meanwhile")
            self._end_trial()
        if replacement is None:
            return
        if isinstance(replacement, str):
            log.error("reload refused, keeping the running configuration: %s", replacement)
            self._ready()
            return
        try:
            self.outputs.reread_secrets()  # the request socket's keys too: it shares the publisher's
        except KeyFileError as e:
            log.error("subscriber keys not reloaded, the previous allow-list stays: %s", e)
        self._end_trial()
        self._trial = Trial(replacement, self.cameras, self._start_capture, self._reloads.retired)
        self._watch()
        short = replacement.model.engine.identity.short
        log.info("loaded model %s (%s): trying it on the next frame", short, changes(self.settings, replacement.settings))

    def _ready(self) -> None:
        """READY=1 as a reload ends, refused or switched in; not while a later one waits or loads: its end says it."""
        if not self._reloads.loading and not self.signals.reload.is_set():
            self.notifier.ready(self.status_line())

    def _end_trial(self) -> None:
        """Back to the running cameras only (`Trial.abandon`), if a reload is on trial, once the frames on the lanes
        are published (or `LANES_RELOAD_WAIT_S` has passed: a frame still running keeps its camera off them)."""
        if self._trial is None:
            return
        self._settle(self.lanes.drain(LANES_RELOAD_WAIT_S))
        self.cameras = self._trial.abandon(self.cameras, self.settings, self._start_capture)
        self._trial = None
        self._watch()

    def _try(self, camera: Camera, frame: Frame) -> None:
        """Switch to a reload's model once it has run on ``frame``, or keep the running one, which serves a frame the reload
        does not take; one that switches is published in free mode only, and not in the warm-up before READY=1."""
        if (trial := self._trial) is None:
            return
        outcome = trial.replacement.trial(camera.id, frame)
        if isinstance(outcome, (Rejected, str)):  # unfit for the reload (the next frame decides), or refused
            if isinstance(outcome, Rejected):
                self._inference_failures += trial.rejected(camera, outcome, self._errors)
            else:
                trial.refused(self.model, camera.id, frame, outcome)
                self._end_trial()
                self._ready()
            if camera.id not in trial.incoming:  # either way the running model serves it, and a request it answers
                self._settle([(camera, camera.path.run(frame))])
            return
        self._switch(trial)
        log.info("reloaded: model %s", self.model.engine.identity.short)
        self._ready()
        switched = self.cameras[camera.id]
        if switched.mode == "free":  # in request mode nobody asked for the trial frame: it is not published
            self._finish(switched, outcome)

    def _switch(self, trial: Trial) -> None:
        """The reload takes over (model, cameras, outputs, requests, thermal watch); the frames on the lanes are published
        first, unless one outlasts `LANES_RELOAD_WAIT_S`: it comes out later with its camera (`edged.lanes.Lanes.resize`)."""
        self._settle(self.lanes.drain(LANES_RELOAD_WAIT_S))
        new = trial.replacement.settings
        self.lanes.resize(new.lanes())
        before = self.settings.requesting()
        self.settings, self.model, self.health.stall_timeout_s = new, trial.replacement.model, new.service.stall_timeout_s
        self.cameras, self._trial = trial.take_over(self.cameras), None
        if self.desk is not None:
            self.desk.follow(new, before)
        self.outputs.reload(new)
        self.thermal, self.report = reloaded_watch(new.thermal, self.thermal, self.report)
        self.candidate.reload(new, trial.replacement.shadow)
        self._watch()
        self._reloads.took_over(trial.replacement)  # what stays dropped, the log level, the replaced models' memory back

    def _finish_lanes(self) -> None:
        """At stop: let the frames on the lanes finish and publish them, each lane's error said alone."""
        while True:
            try:
                self._settle(self.lanes.drain(LANES_STOP_WAIT_S))
                return
            except (ContractError, ModelError) as e:  # another lane's frame failed as the first did: said
                log.error("%s", e)
