"""When kvd router stops asking a replica that leaves its questions unanswered.

A replica that does not answer a route-facts question (its process hung or stopped, its host gone,
packets dropped on the way) costs every request that asks it the question's whole timeout: two
seconds added to each request of the fleet while it stays that way. So the router passes it over
on a request's path for a while after an unanswered question: a backoff that doubles with each
question left unanswered in a row, from `first_seconds` to `max_seconds`. Anything else it answers
ends the rest at once (the events view's load poll, every quarter of a second, which is why that
view lets the backoff grow to a minute). When the backoff runs out, the next request asks it again:
one question, answered (it is back) or not (the backoff doubles); the requests that come while it
is out do not ask too. Where every replica a request could go to rests, they are asked all the
same: a whole fleet passed over would answer no one. Whatever else the router asks of it counts
the same way: a load poll, a status, a listing, an operator's action (RouterService.heard).

The same book, resting only after `after` in a row, keeps a replica whose answers are failures
(500s: its engine failing every step) from drawing the fleet's requests: it answers fastest, so
least-loaded routing would send it the most (RouterService.failing).

Fed plain times on the router's clock; the router keeps one per replica.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Unanswered:
    """One replica's questions left unanswered in a row: when the latest was asked, and until when
    it rests."""

    first_seconds: float = 1.0
    max_seconds: float = 15.0
    after: int = 1  # how many in a row before it rests
    in_a_row: int = 0
    since: float | None = None  # when the latest unanswered question was asked; None: it answers
    run_began: float | None = None  # when the first of the run was asked
    until: float = 0.0  # it rests until then
    probing: bool = False  # a question is out to it after unanswered ones: the others wait for its answer

    def failed(self, asked_at: float, now: float) -> None:
        """A question asked at `asked_at` went unanswered, as is known `now` (a timeout, a refused
        connection, an error): it rests for its backoff from now."""
        self.in_a_row += 1
        self.run_began = asked_at if self.run_began is None else min(self.run_began, asked_at)
        self.since = asked_at if self.since is None else max(self.since, asked_at)
        self.until = max(self.until, now + self.backoff_seconds)
        self.probing = False

    def asking(self) -> None:
        """A question goes out to it now: after unanswered ones, a probe, and it rests meanwhile."""
        self.probing = self.in_a_row >= self.after

    def answered(self) -> None:
        """It answered: the run of unanswered questions is over."""
        self.in_a_row, self.since, self.run_began, self.until, self.probing = 0, None, None, 0.0, False

    @property
    def backoff_seconds(self) -> float:
        """How long it rests after its latest unanswered question: doubled with each in a row."""
        if self.in_a_row < self.after:
            return 0.0
        return min(self.max_seconds, self.first_seconds * 2.0 ** min(self.in_a_row - self.after, 32))

    def resting(self, now: float, heard_at: float | None = None) -> bool:
        """Whether to pass it over now: a question it left unanswered, its rest not over, and
        nothing heard from it since (`heard_at`: when the latest thing it answered was asked)."""
        if self.since is None or self.in_a_row < self.after or (heard_at is not None and heard_at >= self.since):
            return False
        return self.probing or now < self.until

    def silent_seconds(self) -> float:
        """Over how long its questions have gone unanswered, none answered between: from the
        first of the run to the latest, as they were asked (0 with none)."""
        return 0.0 if self.since is None or self.run_began is None else self.since - self.run_began

    def seconds_left(self, now: float) -> float:
        """Seconds until it is asked again (0 when it would be now)."""
        return 0.0 if self.since is None else max(0.0, self.until - now)
