"""A user-space TCP relay that drops, delays or stalls what passes through it, on command.

The kernel here has no netem qdisc, so a host's bad network is played by this relay on the path from
its agent to a coordinator: the agent dials the relay, the relay dials the coordinator. It runs its own
event loop on its own thread; with `netns` that thread enters the host's network namespace first, so
both its listening socket and its upstream connections are the host's (a cut link cuts them too).

Modes, each applying to both directions and to every connection, from the moment it is set:
- `pass_through()`: bytes flow as they come;
- `drop()`: bytes read are thrown away (a black hole: the connections stay open, nothing arrives);
  when it ends, the connections that lost bytes are closed (a TCP stream with a hole in it cannot go
  on), so their ends dial again;
- `delay(s)`: each chunk is delivered `s` seconds after it was read, in order;
- `stall(s)`: nothing is delivered for `s` seconds from now, then everything held flows again.
"""

from __future__ import annotations

import asyncio
import threading
import time

from tests.cluster_box.netns_enter import enter_netns

CHUNK = 65536


class TcpRelay:
    def __init__(self, target: tuple[str, int], listen_host: str = "127.0.0.1", listen_port: int = 0,
                 netns: str | None = None) -> None:
        self.target = target
        self._listen = (listen_host, listen_port)
        self._netns = netns
        self.port = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.AbstractServer | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._damaged: set[asyncio.StreamWriter] = set()  # written to by a connection that lost bytes
        # Read by the pumps on the relay's thread; written from any thread (single assignments).
        self._dropping = False
        self._delay_s = 0.0
        self._stalled_until = 0.0

    @property
    def address(self) -> str:
        return f"{self._listen[0]}:{self.port}"

    # ------------------------------------------------------------ commands (any thread)

    def pass_through(self) -> None:
        self._end_drop()
        self._delay_s, self._stalled_until = 0.0, 0.0

    def drop(self) -> None:
        self._dropping = True

    def delay(self, seconds: float) -> None:
        self._end_drop()
        self._delay_s = seconds

    def _end_drop(self) -> None:
        self._dropping = False
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._close_damaged)

    def _close_damaged(self) -> None:
        for writer in self._damaged:
            writer.close()
        self._damaged.clear()

    def stall(self, seconds: float) -> None:
        self._stalled_until = time.monotonic() + seconds

    # ------------------------------------------------------------ life

    def start(self) -> TcpRelay:
        ready = threading.Event()
        failure: list[BaseException] = []

        def main() -> None:
            try:
                if self._netns:
                    enter_netns(self._netns)
                self._loop = asyncio.new_event_loop()
                self._server = self._loop.run_until_complete(
                    asyncio.start_server(self._accept, self._listen[0], self._listen[1]))
                self.port = self._server.sockets[0].getsockname()[1]
            except BaseException as exc:  # noqa: BLE001 - handed to the starting thread
                failure.append(exc)
                ready.set()
                return
            ready.set()
            self._loop.run_forever()
            self._loop.close()

        self._thread = threading.Thread(target=main, name=f"relay-{self._netns or 'local'}", daemon=True)
        self._thread.start()
        ready.wait(10)
        if failure:
            raise failure[0]
        return self

    def close(self) -> None:
        loop, thread = self._loop, self._thread
        if loop is None or thread is None or not thread.is_alive():
            return

        async def shut() -> None:
            assert self._server is not None
            self._server.close()
            for writer in list(self._writers):
                writer.close()
            tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(shut(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)

    def __enter__(self) -> TcpRelay:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------ the relay's thread

    async def _accept(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection(*self.target)
        except OSError:
            client_writer.close()
            return
        self._writers |= {client_writer, upstream_writer}
        try:
            await asyncio.gather(self._pump(client_reader, upstream_writer),
                                 self._pump(upstream_reader, client_writer))
        except asyncio.CancelledError:
            pass  # the relay is closing (asyncio's stream callback would report a cancelled task)
        finally:
            for writer in (client_writer, upstream_writer):
                self._writers.discard(writer)
                self._damaged.discard(writer)
                writer.close()

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Read as fast as the sender sends; a second task writes each chunk once it is due."""
        held: asyncio.Queue[tuple[float, bytes] | None] = asyncio.Queue()
        deliver = asyncio.ensure_future(self._deliver(held, writer))
        try:
            while data := await reader.read(CHUNK):
                if self._dropping:
                    self._damaged.add(writer)
                else:
                    held.put_nowait((time.monotonic() + self._delay_s, data))
        except OSError:
            pass
        finally:
            held.put_nowait(None)
        try:
            await deliver
        except OSError:
            pass
        finally:
            if writer.can_write_eof():
                try:
                    writer.write_eof()
                except OSError:
                    pass

    async def _deliver(self, held: asyncio.Queue[tuple[float, bytes] | None],
                       writer: asyncio.StreamWriter) -> None:
        while (item := await held.get()) is not None:
            due, data = item
            while (wait := max(due, self._stalled_until) - time.monotonic()) > 0:
                await asyncio.sleep(min(wait, 0.05))  # a stall set meanwhile is seen within 50 ms
            writer.write(data)
            await writer.drain()

