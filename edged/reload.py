"""SIGHUP: the configuration and model to switch to, tried on a real frame before they take over.

Nothing is switched here: the daemon applies what this returns once `Replacement.trial` has run
the new model and its plan on a frame from one of the new configuration's cameras, so a bad
config, a model that will not load, or one that loads but fails on the camera's frames leaves
the running daemon exactly as it was. The loading itself runs on a thread of its own
(`Loading`), so the running model goes on serving the frames while it does. `Trial` owns the
cameras a reload opens while it is on trial, and says which cameras the daemon serves meanwhile
and after.

A provider fallback (the model loaded again without the execution provider that keeps failing)
loads the same way (`FallbackLoading`), taking turns with the reloads (`Reloads`): a board loading
a model on the loop's thread published nothing and fed no watchdog until it ended, if ever. The
provider it drops stays dropped for the reloads that leave ``[runtime] providers`` as it was
(`Dropped`), and the candidate moves with it, loaded on the same thread (`edged.shadow.Shadow.follower`).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Generic, TypeVar, cast

from edged.camera import Camera, Sequences, camera_for, stop_captures
from edged.capture import Capture
from edged.config import ProviderConfig, RuntimeConfig, Settings, load_config
from edged.errors import ConfigError, ContractError, EdgedError, ModelError
from edged.evidence import EvidenceOutput
from edged.files import MadeFolders
from edged.journal import JournalOutput
from edged.lograte import LogRate
from edged.model import LoadedModel, fallback_runtime, load_model
from edged.pipeline import FramePath, Processed, Rejected, frame_path
from edged.reject import check_lines
from edged.service import follow_log_level
from edged.settings.sources import SourceBase
from edged.shadow import Followed, FollowFor, Shadow, Swap, candidate_runtime
from edged.sources.base import Frame
from edged.wake import Waker

log = logging.getLogger(__name__)

CAPTURE_STOP_WAIT_S = 1.0  # how long all the capture threads a reload stops may take, together
StartCapture = Callable[[SourceBase], Capture]
TrialFor = Callable[[Settings, LoadedModel], Shadow | None]  # the candidate's trial beside a model (`edged.candidate`)
Loaded = TypeVar("Loaded")  # what a `Load` loads
RELOAD, FALLBACK = "reload", "provider fallback"  # what a `Load` is, as the log names it


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``; None in a C library without one (musl)."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return cast(Callable[[int], int], trim)


def give_back_freed_memory() -> None:
    """Return the memory the replaced models freed to the system. glibc keeps what a thread freed in
    that thread's arena for its next allocations, and the sessions a reload builds are made on the
    loader's thread while the old ones run: each reload kept 4-20 MB more of the process resident
    (the demo model with a candidate: 203 to 285 MB over 20 reloads) until a plateau of arenas."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def same_source(a: SourceBase, b: SourceBase) -> bool:
    """The same camera opened the same way: a reload keeps its capture running (its
    `SourceBase.PROCESSING_KEYS` may differ, they do not touch the camera)."""
    return a.opening() == b.opening()


@dataclass(frozen=True, slots=True)
class Dropped:
    """The providers that fallbacks dropped (``names``, in turn), and ``left``, those the last one
    loaded the model on. They stay dropped for the reloads whose ``[runtime] providers`` are still
    ``configured``, the configuration's when they were dropped: the file lists the failing provider
    first still, and a reload loading it again failed its trial frame on it, so that no setting could
    change by SIGHUP while it stayed broken. A reload that changes the list is the operator's choice,
    and loads it as given."""

    configured: list[ProviderConfig]
    left: list[ProviderConfig]
    names: tuple[str, ...]

    def kept(self, runtime: RuntimeConfig) -> RuntimeConfig | None:
        """``runtime``, a reloaded configuration's, with the providers left in place of its own,
        said; None when its providers are not those they were dropped from."""
        if runtime.providers != self.configured:
            return None
        log.warning(
            "runtime.providers unchanged: %s stays dropped after inference failed on it, the model loads on %s; "
            "restart edged, or change runtime.providers, to try it again",
            ", ".join(self.names),
            ", ".join(p.name for p in self.left),
        )
        return runtime.model_copy(update={"providers": self.left})


def dropped_after(before: Dropped | None, running: RuntimeConfig, failing: str, left: RuntimeConfig) -> Dropped:
    """What stays dropped once ``failing`` is, ``left`` its fallback's runtime: ``running``, the runtime
    serving, is the configuration's own unless a fallback dropped a provider ``before``."""
    if before is None:
        return Dropped(running.providers, left.providers, (failing,))
    names = before.names if failing in before.names else (*before.names, failing)
    return Dropped(before.configured, left.providers, names)


@dataclass(frozen=True, slots=True)
class Replacement:
    """A reloaded configuration, its model and a frame path per camera, on trial until a frame runs
    through it; the candidate's trial beside its model, if it has one; the providers it keeps
    dropped (`Dropped`), if it does; and the evidence folders it made (`EvidenceOutput.shared`),
    removed again should it not take over (`give_up`)."""

    settings: Settings
    model: LoadedModel
    paths: dict[str, FramePath]  # by camera_id, one per camera of the new configuration
    shadow: Shadow | None = None
    dropped: Dropped | None = None
    made: MadeFolders = field(default_factory=MadeFolders)

    def trial(self, camera_id: str, frame: Frame) -> Processed | Rejected | str:
        """``frame``, from camera ``camera_id``, through the new model: `Processed` when it works,
        the reason when the model fails on it (its warm-up or its run), `Rejected` when the frame
        itself is unfit and the next frame decides."""
        try:
            outcome = self.paths[camera_id].run(frame)
        except (ContractError, ModelError) as e:
            return str(e)
        if isinstance(outcome, Rejected) and outcome.reason == "inference_error":
            return f"inference failed: {outcome.detail}"
        return outcome

    def held(self, running: Settings) -> str | None:
        """Why this reload cannot take over from ``running``: the journal it moves to is another
        edged's. Asked on the loop's thread of the settings running then, not of those running when
        the load began: a reload switched in meanwhile may hold that journal itself (and ``flock``
        conflicts within one process too)."""
        moved = not running.journal.enabled or self.settings.journal.file != running.journal.file
        return JournalOutput.in_use(self.settings) if moved else None

    def give_up(self) -> None:
        """It will not take over (refused, or given up for a newer one): the folders it made for its
        evidence are removed, while still empty and its own, so a refused reload leaves the disk as it was."""
        self.made.remove()


def load_replacement(
    config_path: Path | None,
    running: Settings,
    *,
    requests: bool = False,
    trial_for: TrialFor | None = None,
    reading: Callable[[str], object] = lambda what: None,
    dropped: Dropped | None = None,
) -> Replacement:
    """The new settings with their loaded model (and the candidate's trial beside it, `trial_for`);
    raises an EdgedError when either is unusable, or (`ConfigError`) when they turn request mode on
    or off: ``requests`` says whether the running daemon takes requests, and the request socket is
    bound at start, as the trigger settings say. Cameras may move between the modes while some
    camera stays in request mode. ``reading`` hears each file as it goes to read it, so that a load
    that never ends can say where it stopped (`Loading`). The providers ``dropped`` by a fallback
    stay dropped, for the model and the candidate alike, unless the new settings change
    ``[runtime] providers`` (`Dropped.kept`). Settings that would give two cameras one evidence folder
    are refused here, off the loop, as a start refuses them (`EvidenceOutput.shared`); the folders made
    for that are removed again when the load fails (`Replacement.give_up`). So is a reject line on a
    chip, or of a name or offset, that is not there (`edged.reject.check_lines`, found, not requested:
    the running lines are held), which took over with the camera driving no line, NG parts let go."""
    new = load_config(config_path)
    if bool(new.requesting()) != requests:
        problem = "the reload turns request mode on or off (no camera took requests, or none would): restart edged"
        raise ConfigError(config_path, [problem])
    reading("the evidence folders")
    made = MadeFolders(until_exit=True)  # a load still going at the stop leaves none
    try:
        return _load_replacement(config_path, new, running, made, trial_for, reading, dropped)
    except BaseException:
        made.remove()
        raise


def _load_replacement(
    config_path: Path | None,
    new: Settings,
    running: Settings,
    made: MadeFolders,
    trial_for: TrialFor | None,
    reading: Callable[[str], object],
    dropped: Dropped | None,
) -> Replacement:
    """`load_replacement` once the configuration is read, the folders it makes in ``made``."""
    if (shared := EvidenceOutput.shared(new, made)) is not None:
        raise ConfigError(config_path, [shared])
    if new.rejecting():
        reading("the reject lines")
        check_lines(new, request=False, own=os.getpid())  # a chip or line not there, or held: refused, as at a start
    if dropped is not None and (runtime := dropped.kept(new.runtime)) is not None:
        new = new.model_copy(update={"runtime": runtime})
    else:
        dropped = None
    reading(f"model {new.model.path}")
    model = load_model(new.model, new.runtime, lanes=new.lanes())
    if new.publish != running.publish:
        # The bound socket keeps its endpoints and options, so the settings must say so too
        # (topics are built from them).
        log.warning("publish settings changed: restart edged to apply them")
        new = new.model_copy(update={"publish": running.publish})
    if new.trigger != running.trigger:
        # The request socket, like the PUB socket, stays bound as it is.
        log.warning("trigger settings changed: restart edged to apply them")
        new = new.model_copy(update={"trigger": running.trigger})
    if new.runtime.capture_priority != running.runtime.capture_priority:
        # A capture thread sets its own priority as it starts, and raising it again needs a privilege
        # (CAP_SYS_NICE) the service may lack: the running cameras keep theirs, and those a reload adds take it too.
        log.warning("runtime.capture_priority changed: restart edged to apply it")
        new = new.model_copy(
            update={"runtime": new.runtime.model_copy(update={"capture_priority": running.runtime.capture_priority})}
        )
    kept, candidate = running.model.candidate, new.model.candidate
    if kept is not None and candidate is not None and candidate.control != kept.control:
        # The control socket, too, stays bound where it is (`edged.candidate`).
        log.warning("model.candidate.control changed: restart edged to apply it")
        candidate = candidate.model_copy(update={"control": kept.control})
        new = new.model_copy(update={"model": new.model.model_copy(update={"candidate": candidate})})
    paths = {cfg.camera_id: frame_path(new, model, cfg) for cfg in new.source}
    if new.model.candidate is not None:
        reading(f"candidate model {new.model.candidate.path}")
    return Replacement(new, model, paths, trial_for(new, model) if trial_for is not None else None, dropped, made)


class Load(Generic[Loaded]):
    """A load on a thread of its own: reading, hashing and parsing a model takes seconds on a board (a
    model on a slow or stalled disk, longer), and the loop goes on serving the frames meanwhile.
    ``wake`` is set once it ends; ``at`` says the file it went to read last, for a load that never
    ends to say where it stopped; ``what`` names it in the log.

    Nothing waits for a load stuck there: not a daemon stopping (the thread dies with the process),
    nor, once it counts as stuck, a later reload (`Reloads`).
    """

    def __init__(self, load: Callable[[], Loaded], wake: Waker, *, at: str, what: str) -> None:
        self._outcome: Loaded | str | None = None
        self.at, self.what = at, what
        self._started = time.monotonic()
        try:
            threading.Thread(
                target=self._load, args=(load, wake), name=f"edged-{what.replace(' ', '-')}", daemon=True
            ).start()
        except RuntimeError as e:  # no thread for it: refused as a load that failed, the running configuration kept
            self._outcome = f"{what} not started: {e} (the process may start no more threads: TasksMax= too low, or a leak)"
            wake.set()

    def _load(self, load: Callable[[], Loaded], wake: Waker) -> None:
        try:
            self._outcome = load()
        except EdgedError as e:
            self._outcome = str(e)
        except Exception as e:  # a fault of edged's own: said with its traceback, and the load refused
            log.exception("%s failed", self.what)
            self._outcome = f"unexpected {type(e).__name__}: {e}"
        finally:
            wake.set()

    def outcome(self) -> Loaded | str | None:
        """What it loaded, why it could not, or None while it loads."""
        return self._outcome

    def elapsed_s(self) -> float:
        return time.monotonic() - self._started


class Loading(Load[Replacement]):
    """A reload's configuration and models loading (`load_replacement`): ``at`` goes from the
    configuration (which checks the files it names) to the model and the candidate's, as it reads
    them. Its outcome is the replacement, or why the reload is refused."""

    def __init__(
        self,
        config_path: Path | None,
        running: Settings,
        wake: Waker,
        *,
        requests: bool,
        trial_for: TrialFor,
        dropped: Dropped | None = None,
    ) -> None:
        """`load_replacement`'s arguments, and the loop's wake-up."""
        load = functools.partial(
            load_replacement,
            config_path,
            running,
            requests=requests,
            trial_for=trial_for,
            reading=self._reading,
            dropped=dropped,
        )
        super().__init__(load, wake, at=f"configuration {config_path or '(EDGED_* variables only)'}", what=RELOAD)

    def _reading(self, what: str) -> None:
        self.at = what


@dataclass(frozen=True, slots=True)
class Fallback:
    """The model serving, ``replaces``, loaded again without the provider ``failing`` on which it
    failed ``failures`` frames in a row: the settings that say so, its model with each running
    camera's path through it, to swap in between frames as a promotion is, what stays dropped
    once it has (`Dropped`), and the ``candidate``'s models on the providers left, for it to follow
    (`edged.shadow.Followed`). ``replaces`` is weak: the sessions swapped out are freed at once, for
    `give_back_freed_memory` to return them."""

    settings: Settings
    swap: Swap
    replaces: weakref.ref[LoadedModel]
    failing: str
    failures: int
    dropped: Dropped
    candidate: Followed | None = None

    def takes_over(self, live: LoadedModel) -> bool:
        """Whether it switches in now, in place of ``live``, said either way. Not once a reload, a
        promotion or a rollback has replaced the model it was loaded for: the model serving now was
        tried on frames of its own, and falls back in its turn if it fails as that one did."""
        if live is not self.replaces():
            log.info(
                "the fallback from %s has loaded, but model %s has taken over from the model it was for: dropped",
                self.failing,
                live.engine.identity.short,
            )
            return False
        log.warning(
            "inference failed on %d frames in a row with %s: falling back to %s",
            self.failures,
            self.failing,
            self.swap.model.engine.provider,
            extra={"STAGE": "inference", "MODEL": self.swap.model.engine.identity.short},
        )
        return True


def load_fallback(
    running: Settings,
    live: LoadedModel,
    failing: str,
    runtime: RuntimeConfig,
    sources: Sequence[SourceBase],
    failures: int,
    dropped: Dropped,
    follow: FollowFor | None = None,
) -> Fallback:
    """``live`` loaded again with ``runtime`` (`edged.model.fallback_runtime`), without ``failing``, and
    its path for each of ``sources``, the running cameras'; raises an EdgedError when either cannot be
    made. ``follow`` then loads the candidate's models beside it (`edged.shadow.Shadow.follower`)."""
    promoted = live.cfg.path != running.model.path  # a promoted candidate: its own model settings and runtime
    model = load_model(live.cfg, candidate_runtime(runtime) if promoted else runtime, lanes=running.lanes())
    settings = running.model_copy(update={"runtime": runtime})
    swap = Swap(model, {cfg.camera_id: frame_path(settings, model, cfg) for cfg in sources})
    candidate = follow(settings, swap) if follow is not None else None
    return Fallback(settings, swap, weakref.ref(live), failing, failures, dropped, candidate)


class FallbackLoading(Load[Fallback]):
    """A provider fallback loading (`load_fallback`) as a reload loads (`Loading`): the loop goes on
    meanwhile, its frames still failing on ``failing``, the provider it falls back from, counted
    and skipped."""

    def __init__(self, load: Callable[[], Fallback], failing: str, model: Path, wake: Waker) -> None:
        self.failing = failing
        super().__init__(load, wake, at=f"model {model}", what=FALLBACK)


class Reloads:
    """SIGHUP's configurations and provider fallbacks, loaded one at a time (`Loading`, `FallbackLoading`)
    while the running ones serve: a SIGHUP while one loads waits for it, and loads once the loop has
    taken it; `loading` says whether a reload is under way (systemd hears READY=1 once none is: the
    newest is in).

    A load that has not ended after ``service.load_stuck_s`` may never end (its file on a hung network mount
    or a dying card), and is said in the log: a SIGHUP then loads in its place at once, and the stuck
    load's outcome, should it ever come, is dropped, never switched in over a newer one. One load is
    given up at a time: a SIGHUP while the load given up and the one after it are both stuck is
    refused, saying why, so reloads pressed again and again on a hung disk leave at most two threads
    stuck. Before that time a SIGHUP waits, since a large model loading from a slow card is no fault,
    and two loads side by side would hold two new models in a board's memory at once.

    A provider fallback (`fall_back`) and a reload take turns the same way, first come first served
    (the loop takes a SIGHUP before it counts its failures): neither can stop the other's thread, and
    either may be what makes the frames run. A SIGHUP during a fallback waits for it: the frames are
    failing now, and the fallback switches in first (`takes_over`); the reload then loads on the
    providers it left, unless it changes ``[runtime] providers`` (`Dropped`), and, as any reload,
    takes over only once a frame has run through it (`took_over`). A fallback due during a reload
    waits for that reload, whose model may run where the failing one does not; should the reload
    be refused, or its model fail alike, the fallback loads next. While either
    loads the loop neither stops nor starts a second load; once the load under way counts as stuck,
    frames that keep failing stop edged, for systemd to restart it.
    """

    def __init__(
        self,
        config_path: Path | None,
        wake: Waker,
        reloading: Callable[[], None],
        *,
        requests: bool,
        trial_for: TrialFor,
    ) -> None:
        """``reloading`` tells systemd (RELOADING=1); the rest is `Loading`'s."""
        self._config_path, self._wake, self._reloading = config_path, wake, reloading
        self._requests, self._trial_for = requests, trial_for
        self._loading: Loading | FallbackLoading | None = None
        self._stuck_said = False  # the load under way is said to be stuck
        self._abandoned: Loading | FallbackLoading | None = None  # stuck, given up for a newer load: its outcome is dropped
        self._fell_through = False  # this turn's fallback did not load (`fall_back`)
        self._dropped: Dropped | None = None  # the providers dropped from the configuration's, for the reloads
        # The sequence numbers of the cameras reloads removed, by id: one added back goes on from them, so
        # that no seq of its topics comes twice in a run (`Trial`)
        self.retired: dict[str, Sequences] = {}

    @property
    def loading(self) -> bool:
        """A reload is loading (a provider fallback loading is none: it withholds no READY=1, and
        refuses no promotion, which it gives way to, `Fallback.takes_over`)."""
        return isinstance(self._loading, Loading)

    def take(self, sighup: threading.Event, running: Settings) -> Replacement | Fallback | str | None:
        """What a finished load gives the loop: a reload to try, or why it is refused (a journal another
        edged holds counts, asked of ``running`` now: `Replacement.held`); a fallback to switch in
        (`Fallback.takes_over`), one that did not load being said here and left to `fall_back`. None
        while nothing has finished, starting a load when a SIGHUP is pending and none is under way, or
        the one under way is stuck. Called first in each turn of the loop."""
        self._drop_abandoned()
        self._fell_through = False
        if (loading := self._loading) is not None:
            outcome = loading.outcome()
            if isinstance(outcome, str) and isinstance(loading, FallbackLoading):
                log.error("cannot fall back from %s: %s", loading.failing, outcome)
                self._loading, self._fell_through = None, True
                return None
            if outcome is not None:
                self._loading = None
                if isinstance(outcome, Replacement) and (held := outcome.held(running)) is not None:
                    outcome.give_up()
                    return held
                return outcome
            if loading.elapsed_s() < running.service.load_stuck_s:
                return None
            if not sighup.is_set():
                self._say_stuck(loading)
                return None
            if (before := self._abandoned) is not None:
                sighup.clear()
                return (
                    f"the load under way has not ended after {loading.elapsed_s():.0f} s, at {loading.at}, nor has "
                    f"the one given up for it after {before.elapsed_s():.0f} s, at {before.at} (a stalled disk?): "
                    "one load is given up at a time, so no other starts until one of them ends or edged restarts"
                )
            log.warning(
                "the %s has not ended after %.0f s, at %s (a stalled disk?): loading the configuration "
                "again in its place; what it loads, should it ever end, is dropped",
                loading.what,
                loading.elapsed_s(),
                loading.at,
            )
            self._abandoned, self._loading = loading, None
        if sighup.is_set():
            sighup.clear()
            log.info("reloading configuration from %s", self._config_path)
            self._reloading()
            self._loading = Loading(
                self._config_path,
                running,
                self._wake,
                requests=self._requests,
                trial_for=self._trial_for,
                dropped=self._dropped,
            )
            self._stuck_said = False
        return None

    def fall_back(
        self,
        running: Settings,
        live: LoadedModel,
        sources: Sequence[SourceBase],
        failures: int,
        follower: Callable[[], FollowFor | None] = lambda: None,
    ) -> bool:
        """Whether the loop goes on while inference keeps failing on ``live``, ``failures`` frames in a
        row: a fallback to its next provider starts loading (`FallbackLoading`, `take` hands it over),
        is loading, or waits for the reload under way. False, for the loop to stop, when no provider
        is left below the failing one, this turn's `take` found that the fallback did not load, or
        the load under way is stuck. ``sources`` are the running cameras', for the fallback's paths;
        ``follower`` says, as it starts, what it loads for the candidate (`edged.shadow.Shadow.follower`)."""
        if self._fell_through:
            return False
        if self._loading is not None:
            return self._loading.elapsed_s() < running.service.load_stuck_s
        runtime = fallback_runtime(running.runtime, live)
        if runtime is None:
            return False
        failing = live.engine.providers[0][0]
        dropped = dropped_after(self._dropped, running.runtime, failing, runtime)
        load = functools.partial(load_fallback, running, live, failing, runtime, sources, failures, dropped, follower())
        self._loading = FallbackLoading(load, failing, live.cfg.path, self._wake)
        self._stuck_said = False
        log.warning(
            "inference failed on %d frames in a row with %s: loading model %s for %s, to fall back to it; "
            "the frames go on meanwhile",
            failures,
            failing,
            live.engine.identity.short,
            runtime.providers[0].name,
        )
        return True

    def takes_over(self, fallback: Fallback, live: LoadedModel) -> bool:
        """Whether ``fallback``, handed over by `take`, switches in now in place of ``live``
        (`Fallback.takes_over`); if it does, the provider it drops stays dropped for the reloads."""
        if not fallback.takes_over(live):
            return False
        self._dropped = fallback.dropped
        return True

    def took_over(self, replacement: Replacement) -> None:
        """``replacement`` has switched in: the evidence folders it made are its own, the providers it
        kept dropped stay so for the reloads after it (none where it loaded the providers its
        configuration lists), the log follows its ``service.log_level``, and the memory the models it
        replaced freed goes back to the system (`give_back_freed_memory`)."""
        self._dropped = replacement.dropped
        replacement.made.keep()
        follow_log_level(replacement.settings.service.log_level)
        give_back_freed_memory()

    def _say_stuck(self, loading: Loading | FallbackLoading) -> None:
        """Once per load: it may never end, what it holds back meanwhile, and what a SIGHUP does now."""
        if self._stuck_said:
            return
        self._stuck_said = True
        before = self._abandoned
        log.warning(
            "the %s has been loading for %.0f s, at %s (a file on a slow or stalled disk?): %s; %s (a model "
            "that takes longer to load needs a longer service.load_stuck_s)",
            loading.what,
            loading.elapsed_s(),
            loading.at,
            "promote and rollback are refused until it ends"
            if isinstance(loading, Loading)
            else "edged stops if inference keeps failing meanwhile",
            "a SIGHUP now loads the configuration again in its place"
            if before is None
            else f"the load given up before it, at {before.at}, has not ended either: a SIGHUP is refused until "
            "one of them ends",
        )

    def _drop_abandoned(self) -> None:
        """Let go of the load given up for a newer one once it ends, saying so: a newer reload may then
        take the place of one stuck."""
        if self._abandoned is None or (outcome := self._abandoned.outcome()) is None:
            return
        if isinstance(outcome, Replacement):
            outcome.give_up()
        log.info(
            "the %s given up at %s has ended after %.0f s, %s: dropped",
            self._abandoned.what,
            self._abandoned.at,
            self._abandoned.elapsed_s(),
            f"refused ({outcome})" if isinstance(outcome, str) else "loaded",
        )
        self._abandoned = None


def changes(running: Settings, new: Settings) -> str:
    """What a reload changes, for its log line: the cameras it keeps, adds and removes, and the keys
    whose values differ (``section.key``, a kept camera's as ``source.CAMERA.key``): names only,
    never values, which may be paths or addresses."""
    before, after = {cfg.camera_id: cfg for cfg in running.source}, {cfg.camera_id: cfg for cfg in new.source}
    kept = [name for name in after if name in before]
    added = [name for name in after if name not in before]
    removed = [name for name in before if name not in after]
    old, now = (
        _keys(running.model_dump(mode="json", exclude={"source"})),
        _keys(new.model_dump(mode="json", exclude={"source"})),
    )
    for name in kept:
        old.update(_keys(before[name].model_dump(mode="json"), f"source.{name}."))
        now.update(_keys(after[name].model_dump(mode="json"), f"source.{name}."))
    changed = sorted(key for key in old.keys() | now.keys() if old.get(key) != now.get(key))
    said = [f"cameras kept {', '.join(kept) or 'none'}"]
    said += [f"added {', '.join(added)}"] if added else []
    said += [f"removed {', '.join(removed)}"] if removed else []
    said += [f"changed {', '.join(changed)}" if changed else "no other setting changed"]
    return "; ".join(said)


def _keys(values: object, prefix: str = "") -> dict[str, object]:
    """``values`` (a settings dump) flattened to dotted keys; a list is one value."""
    if not isinstance(values, dict):
        return {prefix.rstrip("."): values}
    flat: dict[str, object] = {}
    for key, value in values.items():
        flat.update(_keys(value, f"{prefix}{key}."))
    return flat


class Trial:
    """A reload on trial: its replacement, and the cameras it adds or opens differently, which run
    beside the others, served by its model only, until a frame decides.

    A camera it opens differently is closed first (a device opens once); cameras it removes keep
    running on the old model until the switch.
    """

    def __init__(
        self,
        replacement: Replacement,
        running: Mapping[str, Camera],
        start: StartCapture,
        retired: dict[str, Sequences] | None = None,
    ) -> None:
        """``retired``: the sequence numbers of cameras removed earlier (`Reloads.retired`), which one
        added back goes on from, and which `take_over` keeps up to date."""
        self.replacement = replacement
        self._retired: dict[str, Sequences] = {} if retired is None else retired
        self.incoming: dict[str, Camera] = {}
        self.reopens = False  # it closed a running camera to open it its own way
        self._unfit_said: set[str] = set()  # the cameras whose frame the reload could not take, said once each
        new = replacement.settings
        for cfg in new.source:
            camera = running.get(cfg.camera_id)
            if camera is not None and same_source(camera.cfg, cfg):
                continue
            if camera is not None:
                camera.capture.stop()
                self.reopens = True
            sequences = self._retired.get(cfg.camera_id) if camera is None else None
            path = replacement.paths[cfg.camera_id]
            self.incoming[cfg.camera_id] = camera_for(new, cfg, start(cfg), path, camera, sequences)

    def refused(self, running: LoadedModel, camera_id: str, frame: Frame, why: str) -> None:
        """Say that the new model failed on ``frame`` of camera ``camera_id``, and ``running`` stays."""
        log.error(
            "reload refused, keeping the running configuration and model %s: the new model %s fails on "
            "frame %d of camera %s: %s",
            running.engine.identity.short,
            self.replacement.model.engine.identity.short,
            frame.frame_id,
            camera_id,
            why,
            extra={"CAMERA": camera_id, "FRAME": frame.frame_id, "STAGE": "reload"},
        )

    def rejected(self, camera: Camera, rejected: Rejected, errors: LogRate) -> int:
        """A frame of ``camera`` the reload's model could not run: an unfit frame of a running camera
        is served by the running model, so it is said once per camera and not counted as dropped;
        any other is the camera's to count and say (`Camera.reject`). Returns the inference failures."""
        if rejected.reason == "inference_error" or camera.id in self.incoming:
            return camera.reject(rejected, errors)
        if camera.id not in self._unfit_said:
            self._unfit_said.add(camera.id)
            log.warning(
                "camera %s: the reload cannot take frame %d (%s): %s; the running model serves its frames until one fits",
                *(camera.id, rejected.frame.frame_id, rejected.reason.removeprefix("bad_frame_"), rejected.detail),
                extra={"CAMERA": camera.id, "FRAME": rejected.frame.frame_id, "STAGE": "reload"},
            )
        return 0

    def takes(self, camera: Camera) -> bool:
        """The trial takes this camera's next frame: it is one of the new configuration's."""
        return camera.id in self.replacement.paths

    def serving(self, running: Mapping[str, Camera]) -> list[Camera]:
        """The cameras the loop takes frames from meanwhile: the running ones, the trial's in place of
        those it opens differently."""
        return [camera for name, camera in running.items() if name not in self.incoming] + list(self.incoming.values())

    def abandon(self, running: Mapping[str, Camera], settings: Settings, start: StartCapture) -> dict[str, Camera]:
        """Back to the running cameras only: those the trial opened are closed, those it closed
        reopened (taking back their counters and sequence numbers); the folders the reload made, removed."""
        stop_captures([camera.capture for camera in self.incoming.values()], CAPTURE_STOP_WAIT_S)
        self.replacement.give_up()
        cameras = dict(running)
        for name, trial in self.incoming.items():
            camera = running.get(name)
            if camera is not None:
                cameras[name] = camera_for(settings, camera.cfg, start(camera.cfg), camera.path, trial)
        return cameras

    def take_over(self, running: Mapping[str, Camera]) -> dict[str, Camera]:
        """The cameras once the reload takes over: its own, a running camera it opens the same way
        keeping its capture; those it removes are stopped."""
        new, paths = self.replacement.settings, self.replacement.paths
        cameras = {}
        for cfg in new.source:
            camera = self.incoming.get(cfg.camera_id)
            if camera is None:
                previous = running[cfg.camera_id]
                camera = camera_for(new, cfg, previous.capture, paths[cfg.camera_id], previous)
            cameras[cfg.camera_id] = camera
        removed = [camera for name, camera in running.items() if name not in cameras]
        for camera in removed:
            log.info("camera %s removed", camera.id, extra={"CAMERA": camera.id})
            self._retired[camera.id] = camera.sequences
        stop_captures([camera.capture for camera in removed], CAPTURE_STOP_WAIT_S)
        for name in cameras.keys() - running.keys():
            log.info("camera %s added", name, extra={"CAMERA": name})
            self._retired.pop(name, None)
        return cameras
