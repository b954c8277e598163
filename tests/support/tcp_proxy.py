"""A TCP proxy for fault tests: put it between a client and a real server, then make the
network misbehave on demand.

Modes:
- ``forward``: bytes flow both ways (the normal case);
- ``blackhole()``: connections stay open and accept bytes, but nothing is forwarded either
  way, and new connections are accepted the same way (a hung node or a silent network drop);
- ``refuse()``: the listening port is closed and every open connection is reset (a stopped
  node: connection refused);
- ``resume()``: forward again on the same port; connections that were black-holed are reset,
  so no late answer to an abandoned request can reach a reused keep-alive connection.

Runs on the event loop that started it (the test's loop).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import socket


class Mode(enum.Enum):
    FORWARD = "forward"
    BLACKHOLE = "blackhole"
    REFUSE = "refuse"


class _Link:
    """One client connection and (unless black-holed from the start) its upstream."""

    def __init__(self, client: asyncio.StreamWriter) -> None:
        self.client = client
        self.upstream: asyncio.StreamWriter | None = None
        self.tasks: list[asyncio.Task[None]] = []
        self.tainted = False  # saw the black hole: must not carry traffic again

    def abort(self) -> None:
        for writer in (self.client, self.upstream):
            if writer is not None:
                with contextlib.suppress(Exception):
                    writer.transport.abort()
        for task in self.tasks:
            task.cancel()


class TcpProxy:
    def __init__(self, target_host: str, target_port: int, listen_port: int = 0) -> None:
        self.target = (target_host, target_port)
        self.port = listen_port
        self.mode = Mode.FORWARD
        self._server: asyncio.Server | None = None
        self._links: set[_Link] = set()
        self._flowing = asyncio.Event()
        self._flowing.set()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> TcpProxy:
        await self._listen()
        return self

    async def _listen(self) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", self.port))
        self.port = sock.getsockname()[1]
        self._server = await asyncio.start_server(self._accept, sock=sock)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        link = _Link(writer)
        self._links.add(link)
        try:
            if self.mode is not Mode.FORWARD:
                link.tainted = True
                await self._drain(reader)  # swallow the request, never answer
                return
            try:
                up_reader, up_writer = await asyncio.open_connection(*self.target)
            except OSError:
                writer.transport.abort()
                return
            link.upstream = up_writer
            pumps = [
                asyncio.ensure_future(self._pump(reader, up_writer, link)),
                asyncio.ensure_future(self._pump(up_reader, writer, link)),
            ]
            link.tasks = pumps
            await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        finally:
            link.abort()
            self._links.discard(link)

    async def _drain(self, reader: asyncio.StreamReader) -> None:
        with contextlib.suppress(Exception):
            while await reader.read(65536):
                pass

    async def _pump(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, link: _Link
    ) -> None:
        with contextlib.suppress(Exception):
            while True:
                data = await reader.read(65536)
                if not data:
                    break
                if not self._flowing.is_set():
                    link.tainted = True  # drop: this byte stream is now corrupt
                    continue
                writer.write(data)
                await writer.drain()

    def blackhole(self) -> None:
        """Stop forwarding; keep accepting (a hung peer)."""
        self.mode = Mode.BLACKHOLE
        self._flowing.clear()
        for link in self._links:
            link.tainted = True

    async def refuse(self) -> None:
        """Close the port and reset every connection (a stopped peer)."""
        self.mode = Mode.REFUSE
        self._flowing.clear()
        await self._close_server()
        for link in list(self._links):
            link.abort()

    async def resume(self) -> None:
        """Forward again on the same port; reset connections the fault left half-used."""
        for link in [link for link in self._links if link.tainted]:
            link.abort()
        self.mode = Mode.FORWARD
        self._flowing.set()
        if self._server is None:
            await self._listen()

    async def _close_server(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 1.0)
            self._server = None

    async def close(self) -> None:
        await self._close_server()
        for link in list(self._links):
            link.abort()
        self._links.clear()


def free_port() -> int:
    """A port nothing listens on right now (for "connection refused" checks)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
