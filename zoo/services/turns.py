"""Working turns and store order for the sources an Ingestor has in flight (zoo.services.ingest.ingest_sources).

One source at a time is read, canonicalized and described: it holds the working turn. Its turn comes with a ticket,
handed out in the order the turns are taken, and stores go in ticket order: a source stores once every source with an
earlier ticket has finished (stored, found a duplicate, or failed). A source gives its turn back as soon as its work
is done, before it waits for its blob's upload and for the stores before it, so the next source is worked on
meanwhile, and several blobs can be going up at once while their stores wait in line."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager


class Turns:
    """An Ingestor's turns and tickets: `take()` waits until the source before has given its working turn back."""

    def __init__(self) -> None:
        self._working = threading.Lock()
        self._order = threading.Condition()
        self._issued = 0  # the next ticket
        self._serving = 0  # the earliest ticket not finished: the one that may store now
        self._finished: set[int] = set()  # tickets finished out of order (a failure while one before is still storing)

    def take(self) -> Turn:
        self._working.acquire()
        with self._order:
            ticket, self._issued = self._issued, self._issued + 1
        return Turn(self, ticket)

    def release_work(self) -> None:
        self._working.release()

    def wait_for(self, ticket: int) -> None:
        """Until every ticket before `ticket` is finished."""
        with self._order:
            self._order.wait_for(lambda: self._serving >= ticket)

    def finish(self, ticket: int) -> None:
        with self._order:
            self._finished.add(ticket)
            while self._serving in self._finished:
                self._finished.discard(self._serving)
                self._serving += 1
            self._order.notify_all()


class Turn:
    """One source's working turn and its ticket. `release()` gives the working turn back (once); `in_order()` waits
    until every source before this one has finished, and is exclusive until this one finishes; `finish()` (which
    releases too) lets the next source store. Every turn taken must be finished, however its source ends."""

    def __init__(self, turns: Turns, ticket: int) -> None:
        self._turns = turns
        self.ticket = ticket
        self._working = True
        self._finished = False
        self._lock = threading.Lock()

    def release(self) -> None:
        with self._lock:
            working, self._working = self._working, False
        if working:
            self._turns.release_work()

    @contextmanager
    def in_order(self) -> Iterator[None]:
        self._turns.wait_for(self.ticket)
        yield

    def finish(self) -> None:
        self.release()
        with self._lock:
            finished, self._finished = self._finished, True
        if not finished:
            self._turns.finish(self.ticket)
