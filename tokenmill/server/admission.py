"""Admission control: a bound on the work the server holds, counted in sequences (a request with
n samples over k prompts is n * k), so an overload is refused at once with a 429 instead of
queueing without end.

The bound is `max_num_seqs` (what the engine runs at once) + `max_waiting_requests` (what may
wait behind them). A request larger than the whole bound can never be served and is a 400; one
that does not fit now is a 429 with Retry-After. A ticket is taken before the request is
tokenized (so tokenization work is bounded too) and released when its response has been sent
or its stream has ended, whichever way.

Invariant: `in_flight` is the sum of the sizes of the unreleased tickets, never above
`capacity`. Everything runs on the event loop, so no lock is needed.
"""

from __future__ import annotations

RETRY_AFTER_S = 1


class Overloaded(Exception):
    """The server holds as much work as it admits; try again later (a 429)."""


class Ticket:
    def __init__(self, owner: AdmissionControl, size: int) -> None:
        self._owner, self.size, self._released = owner, size, False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._owner.in_flight -= self.size
            self._owner.requests -= 1

    def __del__(self) -> None:  # a response dropped before it ran (client gone at once)
        self.release()


class AdmissionControl:
    def __init__(self, max_num_seqs: int, max_waiting: int) -> None:
        self.capacity = max_num_seqs + max_waiting
        self.in_flight = 0  # sequences admitted and not yet released
        self.requests = 0  # requests admitted and not yet released

    def full(self) -> str | None:
        """Why no request can be admitted now (none fits, whatever its size), or None."""
        return None if self.in_flight < self.capacity else self._at_capacity()

    def _at_capacity(self) -> str:
        return (f"the server is at capacity ({self.in_flight} of {self.capacity} sequences in "
                f"flight); retry after {RETRY_AFTER_S} s")

    def admit(self, size: int) -> Ticket:
        """A ticket for `size` sequences; ValueError if it can never fit, Overloaded if it
        does not fit now."""
        if size > self.capacity:
            raise ValueError(f"n must keep a request within the server's capacity of "
                             f"{self.capacity} sequences (max_num_seqs + max_waiting_requests); "
                             f"this one asks for {size} (n x prompts)")
        if self.in_flight + size > self.capacity:
            raise Overloaded(self._at_capacity())
        self.in_flight += size
        self.requests += 1
        return Ticket(self, size)
