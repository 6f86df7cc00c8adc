"""``[model.candidate]`` as the loop runs it: the shadow trial (`edged.shadow`) and the control
socket that promotes or rolls it back (`edged.control`), behind the few calls the daemon makes.

The control socket is bound at start and stays for the process's life; a reload replaces the
trial (or ends it, when the candidate is gone: the socket then refuses each command, `serve`), and
one that adds a candidate to a daemon started without one asks for a restart, since the socket
cannot be bound then.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from edged.camera import Camera
from edged.config import Settings
from edged.control import ControlSocket
from edged.journal import JournalOutput
from edged.messages import CandidateReport
from edged.model import LoadedModel
from edged.pipeline import Processed
from edged.requests import RequestDesk
from edged.shadow import Followed, FollowFor, Shadow, Swap

log = logging.getLogger(__name__)


class Candidate:
    """The trial of a candidate model and its control socket, when ``[model.candidate]`` is set at
    start; every call does nothing without one. Raises as `ControlSocket` does."""

    def __init__(self, settings: Settings, live: LoadedModel) -> None:
        cfg = settings.model.candidate
        self.shadow: Shadow | None = None  # set before the socket binds: `close` reads it if the trial fails
        self.control = ControlSocket(cfg.control) if cfg is not None else None
        try:
            self._begin(Shadow(settings, cfg, live) if cfg is not None else None)
        except BaseException:
            self.close()
            raise

    def _begin(self, shadow: Shadow | None) -> None:
        """``shadow``'s trial starts, or is off for the reason it gives: said here rather than as it
        loads, which a reload does before its model is tried and may then be refused."""
        self.shadow = shadow
        if shadow is not None and shadow.model is not None:
            log.info("candidate model %s on trial beside the live model", shadow.model.engine.identity.short)
        elif shadow is not None:
            log.error("%s; the live model goes on alone", shadow.error)

    @property
    def fds(self) -> list[Any]:
        """What the loop's wait selects on: commands arriving."""
        return self.control.fds if self.control is not None else []

    def serve(
        self, current: Callable[[], Swap], apply: Callable[[Swap], None], blocked: str | None, journal: JournalOutput | None
    ) -> None:
        """Answer the commands waiting (`ControlSocket.serve`); without a trial each is refused."""
        if self.control is not None:
            self.control.serve(self.shadow, current, apply, blocked, journal)

    def observe(self, camera_id: str, done: Processed) -> None:
        if self.shadow is not None:
            self.shadow.observe(camera_id, done)

    def run(self, cameras: Sequence[Camera], desk: RequestDesk | None) -> bool:
        """Run the candidate in the time the loop would wait, if it fits (`Shadow.spare_s`)."""
        return self.shadow is not None and self.shadow.run(self.shadow.spare_s(cameras, desk))

    def report(self) -> CandidateReport | None:
        return self.shadow.report() if self.shadow is not None else None

    def trial_for(self, settings: Settings, live: LoadedModel) -> Shadow | None:
        """A reload's candidate on a fresh trial beside the reload's model ``live``, loaded with it
        off the loop's thread (`edged.reload.Loading`); None without a candidate, or without the
        control socket to serve one."""
        cfg = settings.model.candidate
        return Shadow(settings, cfg, live) if cfg is not None and self.control is not None else None

    def follower(self) -> FollowFor | None:
        """What a provider fallback starting now loads for the candidate (`Shadow.follower`)."""
        return self.shadow.follower() if self.shadow is not None else None

    def fell_back(self, followed: Followed | None, live: Swap) -> None:
        """A provider fallback switched ``live`` in, loaded with ``followed`` (`follower`): a candidate on
        trial starts again beside it, a promoted one's models move onto the providers left with it
        (`Shadow.fell_back`). Said here, as for a reload, rather than as it loaded: it may not have
        switched in."""
        shadow, provider = self.shadow, live.model.engine.provider
        if followed is None or shadow is None:
            return
        if followed.trial is not None:
            log.warning("the candidate follows the live model onto %s: its trial starts again from zero", provider)
            shadow.close()
            self._begin(followed.trial)
            return
        kept, previous = followed.kept if isinstance(followed.kept, Swap) else None, shadow.previous
        if kept is not None:
            log.warning("the model kept for rollback follows the live model onto %s", provider)
        elif previous is not None:
            log.error(
                "the model kept for rollback, %s, did not load on %s (%s): a rollback brings it back on %s",
                previous.engine.identity.short,
                provider,
                followed.kept,
                previous.engine.provider,
            )
        shadow.fell_back(live, kept)

    def reload(self, settings: Settings, shadow: Shadow | None) -> None:
        """A reload's candidate goes on its fresh trial (`trial_for`); without one, the trial ends
        (`serve` refuses each command then). One added to a daemon started without one is said, not
        served: its socket is bound only at start."""
        if self.control is None:
            if settings.model.candidate is not None:
                log.warning("[model.candidate] added by a reload: restart edged to bind its control socket")
            return
        if self.shadow is not None:
            self.shadow.close()
        self._begin(shadow)

    def close(self) -> None:
        if self.shadow is not None:
            self.shadow.close()
        if self.control is not None:
            self.control.close()
