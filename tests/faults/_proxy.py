"""A TCP proxy on loopback that a test uses to cut the path to Redis.

The middleware talks to the proxy, the proxy to the server. The test can
``cut()`` the path (every open connection is reset and new ones are refused),
``restore()`` it (the proxy listens again on the same port), or ``hang()`` it
(connections stay open and new ones are accepted, but no byte goes through in
either direction, as with a network that silently drops packets). The proxy
keeps a copy of every byte the client sent, so a test can prove what never
travelled to Redis.
"""

from __future__ import annotations

import asyncio
import contextlib

from tests._server import free_port

_CHUNK = 65536


class Proxy:
    """Forwards loopback connections on ``port`` to ``target_port``."""

    def __init__(self, target_port: int, port: int | None = None) -> None:
        """Prepare a proxy to the server on ``target_port``; nothing listens yet."""
        self.target_port = target_port
        self.port = port if port is not None else free_port()
        self.sent_by_client = bytearray()
        self.accepted = 0
        self._listener: asyncio.Server | None = None
        self._hung = False
        self._transports: set[asyncio.BaseTransport] = set()
        self._pumps: set[asyncio.Task[None]] = set()

    def url(self, query: str = "", *, userinfo: str = "", db: int = 0) -> str:
        """The ``redis://`` URL that goes through the proxy."""
        at = f"{userinfo}@" if userinfo else ""
        return f"redis://{at}127.0.0.1:{self.port}/{db}{'?' + query if query else ''}"

    @property
    def listening(self) -> bool:
        """Whether new connections are accepted."""
        return self._listener is not None

    async def start(self) -> Proxy:
        """Listen on the proxy port."""
        self._listener = await asyncio.start_server(self._serve, "127.0.0.1", self.port)
        return self

    async def cut(self) -> None:
        """Reset every open connection and refuse new ones until :meth:`restore`."""
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        self._reset_all()

    async def restore(self) -> None:
        """Let traffic through again and accept new connections."""
        self._hung = False
        if self._listener is None:
            await self.start()

    def hang(self) -> None:
        """Keep every connection open but let no byte through, until :meth:`restore`."""
        self._hung = True

    async def close(self) -> None:
        """Stop listening, reset every connection, and wait for the pumps to end."""
        await self.cut()
        for pump in list(self._pumps):
            pump.cancel()
        for pump in list(self._pumps):
            with contextlib.suppress(asyncio.CancelledError):
                await pump

    def _reset_all(self) -> None:
        for transport in list(self._transports):
            if isinstance(transport, asyncio.WriteTransport):
                transport.abort()  # an RST, as a broken network path gives
            else:
                transport.close()
        self._transports.clear()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        self._transports.add(writer.transport)
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.transport.abort()
            self._transports.discard(writer.transport)
            return
        self._transports.add(up_writer.transport)
        loop = asyncio.get_running_loop()
        for task in (
            loop.create_task(self._pump(reader, up_writer, record=True)),
            loop.create_task(self._pump(up_reader, writer, record=False)),
        ):
            self._pumps.add(task)
            task.add_done_callback(self._pumps.discard)

    async def _pump(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, record: bool
    ) -> None:
        try:
            while data := await reader.read(_CHUNK):
                if record:
                    self.sent_by_client += data
                if self._hung:
                    continue  # swallowed, as a black-holed network path would
                writer.write(data)
                await writer.drain()
        except OSError:
            pass
        finally:
            self._transports.discard(writer.transport)
            writer.transport.abort()
