"""A TCP proxy that can hold every reply back: a slow database or broker, as its clients
see it; or cut them off.

Requests go through at once, so the server applies a write whose reply then arrives after
the client gave up on it, as with a MongoDB that is overloaded or a network that stalls.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from urllib.parse import urlsplit, urlunsplit

CHUNK = 64 * 1024
DEFAULT_PORTS = {"mongodb": 27017, "amqp": 5672}


@dataclass
class SlowLink:
    """Listens on a free local port and forwards each connection to `upstream` (host, port).

    While `reply_delay_s` is above zero every chunk the server sends is held back that long
    before it is passed on (in order, per connection). While `down`, every connection is
    closed at once: the server is unreachable (`cut` also ends the open ones).

    `latency_s` is a long link instead: each reply arrives that long after the server sent
    it, replies in flight together arriving together. `rounds` counts the replies that found
    none of their connection's in flight: the round trips a client made one after another.
    """

    upstream: tuple[str, int]
    reply_delay_s: float = 0.0
    latency_s: float = 0.0
    down: bool = False
    rounds: int = field(default=0, init=False)
    _server: asyncio.Server | None = field(default=None, init=False)
    _pipes: set[asyncio.Task[None]] = field(default_factory=set, init=False)
    _writers: set[asyncio.StreamWriter] = field(default_factory=set, init=False)

    @classmethod
    def to_mongo(cls, url: str) -> SlowLink:
        return cls.to(url)

    @classmethod
    def to(cls, url: str) -> SlowLink:
        """A link to the server of `url` (MongoDB or RabbitMQ)."""
        parts = urlsplit(url)
        return cls((parts.hostname or "127.0.0.1", parts.port or DEFAULT_PORTS[parts.scheme]))

    def url_through(self, url: str, *, query: str | None = None) -> str:
        """`url` (credentials, path and all) reaching its server through this link."""
        parts = urlsplit(url)
        credentials = parts.netloc.rpartition("@")[0]
        netloc = f"{credentials}@127.0.0.1:{self.port}" if credentials else f"127.0.0.1:{self.port}"
        changed = parts._replace(netloc=netloc, query=parts.query if query is None else query)
        return urlunsplit(changed)

    @property
    def port(self) -> int:
        assert self._server is not None, "not started"
        port: int = self._server.sockets[0].getsockname()[1]
        return port

    @property
    def mongo_url(self) -> str:
        return f"mongodb://127.0.0.1:{self.port}/?directConnection=true"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._connect, "127.0.0.1", 0)

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[SlowLink]:
        """Started for the block; healed (up, no delay) and stopped after it."""
        await self.start()
        try:
            yield self
        finally:
            self.down, self.reply_delay_s = False, 0.0
            await self.stop()

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for pipe in list(self._pipes):
            pipe.cancel()
        await asyncio.gather(*self._pipes, return_exceptions=True)
        # Both ends of every connection, closed here: a connection's handler may not run
        # again before the test ends, and its sockets would be left to the collector.
        await _closed(self._writers)
        if self._server is not None:
            await self._server.wait_closed()

    async def cut(self) -> None:
        """The server goes away: open connections end, new ones are closed at once."""
        self.down = True
        for pipe in list(self._pipes):
            pipe.cancel()

    async def _connect(
        self, client_in: asyncio.StreamReader, client_out: asyncio.StreamWriter
    ) -> None:
        if self.down:
            client_out.close()
            return
        try:
            server_in, server_out = await asyncio.open_connection(*self.upstream)
        except OSError:
            client_out.close()
            return
        writers = {server_out, client_out}
        self._writers |= writers
        requests = asyncio.create_task(self._pipe(client_in, server_out, held=False))
        replies = asyncio.create_task(
            self._late(server_in, client_out)
            if self.latency_s > 0
            else self._pipe(server_in, client_out, held=True)
        )
        self._pipes |= {requests, replies}
        await asyncio.wait({requests, replies}, return_when=asyncio.FIRST_COMPLETED)
        for pipe in (requests, replies):
            pipe.cancel()
            self._pipes.discard(pipe)
        await asyncio.gather(requests, replies, return_exceptions=True)
        self._writers -= writers
        await _closed(writers)

    async def _pipe(
        self, source: asyncio.StreamReader, sink: asyncio.StreamWriter, *, held: bool
    ) -> None:
        with contextlib.suppress(ConnectionError):
            while chunk := await source.read(CHUNK):
                if held and self.reply_delay_s > 0:
                    await asyncio.sleep(self.reply_delay_s)  # the injected fault itself
                sink.write(chunk)
                await sink.drain()

    async def _late(self, source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
        """Every chunk passed on `latency_s` after it was read, in order."""
        loop = asyncio.get_running_loop()
        in_flight: asyncio.Queue[tuple[float, bytes] | None] = asyncio.Queue()
        unsent = 0  # chunks read and not passed on yet

        async def arrive() -> None:
            nonlocal unsent
            while (next_one := await in_flight.get()) is not None:
                due, chunk = next_one
                await asyncio.sleep(due - loop.time())
                sink.write(chunk)
                await sink.drain()
                unsent -= 1

        arriving = asyncio.create_task(arrive())
        try:
            with contextlib.suppress(ConnectionError):
                while chunk := await source.read(CHUNK):
                    if unsent == 0:
                        self.rounds += 1
                    unsent += 1
                    in_flight.put_nowait((loop.time() + self.latency_s, chunk))
                in_flight.put_nowait(None)
                await arriving
        finally:
            arriving.cancel()
            await asyncio.gather(arriving, return_exceptions=True)


async def _closed(writers: set[asyncio.StreamWriter]) -> None:
    for writer in list(writers):
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
