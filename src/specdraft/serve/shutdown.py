"""Graceful shutdown of the server: on SIGTERM (or SIGINT) it stops taking requests, lets those in flight finish
within a grace period, then ends the rest cleanly, and only then lets uvicorn close.

Timeline, with grace period G (``--shutdown-grace``) and reserve R = min(1 s, G / 2):

1. at once: new completion requests answer 503 with OpenAI's error body, ``/health`` answers 503 ``draining``;
   the listening socket stays open so that clients get that answer rather than a refused connection;
2. until G - R: requests already accepted (running or queued) go on and finish normally;
3. at G - R: each one still in flight ends: a stream with an OpenAI-style error event and ``data: [DONE]``, a
   non-streaming request with a 503 JSON error body; its sequences leave the batch;
4. once they have answered (at the latest G - R / 2), uvicorn shuts down: the engine thread and the online trainer
   stop, and the process exits, within G.

A second signal during the drain hands over to uvicorn's own shutdown at once (SIGINT twice forces it).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import uvicorn

from specdraft.serve.engine import Event, Request

SHUTDOWN_MESSAGE = "the server is shutting down"
_POLL_S = 0.02


class Drain:
    """The requests in flight and the drain that ends them; lives on the event loop."""

    def __init__(self, grace: float, cancel: Callable[[Request], None]) -> None:
        """``cancel``: takes a request's sequences out of the engine (:meth:`~specdraft.serve.engine.Engine.cancel`)."""
        self.grace, self.cancel = grace, cancel
        self.draining = False
        self.live: set[Request] = set()
        self.loop: asyncio.AbstractEventLoop | None = None  # set when the app starts
        self._task: asyncio.Task | None = None

    @property
    def reserve(self) -> float:
        return min(1.0, self.grace / 2)

    def begin(self, done: Callable[[], None]) -> None:
        """Start draining (on the event loop); call ``done`` once every request has answered."""
        if self._task is None:
            self.draining = True
            self._task = asyncio.ensure_future(self._run(done))

    async def _run(self, done: Callable[[], None]) -> None:
        start = time.monotonic()
        await self._settle(start + self.grace - self.reserve)
        for request in list(self.live):  # past the grace period: end it cleanly, now
            self.cancel(request)
            if request.events is not None:
                request.events.put_nowait(Event(error=SHUTDOWN_MESSAGE, status=503))
        await self._settle(start + self.grace - self.reserve / 2)
        done()

    async def _settle(self, deadline: float) -> None:
        while self.live and time.monotonic() < deadline:
            await asyncio.sleep(_POLL_S)


class GracefulServer(uvicorn.Server):
    """uvicorn's server whose first SIGTERM or SIGINT drains the app (``drain``, the app's :class:`Drain`) before
    uvicorn's own shutdown; a second signal hands over to uvicorn at once."""

    def __init__(self, settings: uvicorn.Config, drain: Drain) -> None:
        super().__init__(settings)
        self.drain, self.signalled = drain, False

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started and sockets:  # uvicorn names the address only for sockets it bound itself
            host, port = sockets[0].getsockname()[:2]
            logging.getLogger("uvicorn.error").info("Uvicorn running on http://%s:%s (SIGTERM or CTRL+C: shut down "
                                                    "within %g s)", host, port, self.drain.grace)

    def handle_exit(self, sig, frame) -> None:
        if self.signalled or self.drain.loop is None:  # a second signal, or one before the app started
            super().handle_exit(sig, frame)
            return
        self.signalled = True
        self.drain.loop.call_soon_threadsafe(self.drain.begin, lambda: super(GracefulServer, self).handle_exit(sig,
                                                                                                               None))
