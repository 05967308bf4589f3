"""Every wait on another party is bounded or heard: the one rule for asking again after "not now".

A caller that is refused with something that changed nothing (a peer's closed admission, a server
or the database restarting) asks again through one `Patience`. It backs off, says in the log once
the wait has lasted longer than a checkpoint should take (and again every `remind_s` while it
lasts), and, where the wait has a limit, gives up past it by raising the last refusal, so that the
caller's own caller hears why instead of waiting without a word.

A closed admission has no limit of its own: it ends when the peer's checkpoint ends, and how long
that may take is the checkpoint's lease, which the peer enforces (a framework may hold a paused
checkpoint while it publishes state of its own). A peer or a database that does not answer has one
(PEER_PATIENCE_S): past it the work is handed back to recovery.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

log = logging.getLogger("rollbook.wait")

RETRY_FIRST_S = 0.05
RETRY_MAX_S = 1.0
SOON_S = 0.005  # asking again a peer whose resume is on its way (engine.admission.Admission.callee_resuming)
SOON_TRIES = 50  # ... that many times at most: a resume that failed leaves the peer closed until its lease
PEER_PATIENCE_S = 120.0  # how long a caller waits for a server (or the database) that does not answer
SPEAK_AFTER_S = 15.0  # longer than a checkpoint's prepare-to-resume takes on a healthy run
REMIND_S = 60.0


@dataclass
class Patience:
    """One wait: `what` names it in the log (the rollout and the peer, say)."""

    what: str
    limit_s: float | None = PEER_PATIENCE_S
    speak_after_s: float = SPEAK_AFTER_S
    remind_s: float = REMIND_S
    max_delay_s: float = RETRY_MAX_S
    since: float = field(default_factory=time.monotonic)
    tries: int = 0
    soon_tries: int = 0
    spoken_at: float | None = None

    def waited(self, now: float | None = None) -> float:
        return (time.monotonic() if now is None else now) - self.since

    def next_delay(self, refusal: BaseException, now: float | None = None, soon: bool = False) -> float:
        """Seconds to wait before asking again after `refusal`; raises `refusal` past the limit.

        `soon`: the refusal is about to end (a peer closed for a checkpoint the caller has already
        resumed from): SOON_S, for up to SOON_TRIES such refusals, before the back-off grows."""
        waited = self.waited(now)
        if self.limit_s is not None and waited > self.limit_s:
            log.error("%s: gave up after %.0f s of %s", self.what, waited, _say(refusal))
            raise refusal
        if waited > self.speak_after_s and (self.spoken_at is None or waited - self.spoken_at >= self.remind_s):
            self.spoken_at = waited
            until = "without a limit" if self.limit_s is None else f"for up to {self.limit_s:.0f} s"
            log.warning("%s: still waiting after %.0f s (%s); asking again %s", self.what, waited, _say(refusal), until)
        if soon and self.soon_tries < SOON_TRIES:
            self.soon_tries += 1
            return SOON_S
        delay: float = min(self.max_delay_s, RETRY_FIRST_S * 2.0 ** min(self.tries, 5))
        self.tries += 1
        return delay


def _say(refusal: BaseException) -> str:
    code = getattr(refusal, "code", None)
    return f"{code}: {refusal}" if code else f"{type(refusal).__name__}: {refusal}"
