"""Calls that reach the coordinator faster than its event loop takes them (an agents' connect burst, a
failover) wait in the gRPC core's queue, and the core must hold them rather than cancel them.

At its defaults (grpc.server.max_pending_requests 1000, hard limit 3000) gRPC cancels calls waiting for
the application with a probability that rises from 0 at 1,000 waiting to 1 at 3,000. At 10,000 agents
connecting at once that was most of the burst's failed attempts: `CANCELLED`, or `INTERNAL` where the
agent's Hello write met the ended stream, and each one another attempt. The coordinator answers
overload itself, with a retry-after hint the agents follow (daemon/admission.py), so the core's queue is
sized for every session it may hold (daemon/app.py grpc_server).

gRPC also cancels a call that waited 30 s for the application (`grpc.server_max_unrequested_time_in_server`).
At 20,000 agents at once calls waited longer than that, and hundreds to thousands of Hellos a run ended
`CANCELLED` though their agents would have waited 60 s; the core now holds a call as long as an agent waits
for its Welcome."""

from __future__ import annotations

import asyncio
import collections
import threading
import time

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from daemon.app import grpc_server

CALLS = 4000  # past the default hard limit: at the defaults every call beyond 3,000 is cancelled
GRPC_DEFAULT_WAIT_S = 30  # at gRPC's default every call still waiting then is cancelled


def test_calls_waiting_for_a_busy_event_loop_are_held_past_grpcs_30_s_and_answered_not_cancelled() -> None:
    async def scenario() -> collections.Counter[str]:
        server = grpc_server()
        port = server.add_insecure_port("127.0.0.1:0")
        health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
        await server.start()
        fire, issued = threading.Event(), threading.Event()
        codes: collections.Counter[str] = collections.Counter()

        def burst() -> None:
            with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                grpc.channel_ready_future(channel).result(timeout=10)
                stub = health_pb2_grpc.HealthStub(channel)
                fire.wait(10)
                calls = [stub.Check.future(health_pb2.HealthCheckRequest(), timeout=60) for _ in range(CALLS)]
                issued.set()
                for call in calls:
                    try:
                        call.result()
                        codes["OK"] += 1
                    except grpc.RpcError as exc:
                        codes[exc.code().name] += 1

        client = threading.Thread(target=burst, daemon=True)
        client.start()
        try:
            # Hold the server's event loop, as a burst does: no call is taken from the core meanwhile.
            fire.set()
            assert issued.wait(30)
            # Blocking is the point: the core reads every call off the connection, and they wait there past
            # gRPC's default limit.
            time.sleep(GRPC_DEFAULT_WAIT_S + 2)  # noqa: ASYNC251
            await asyncio.to_thread(client.join, 90)
            assert not client.is_alive()
        finally:
            await server.stop(None)
        return codes

    codes = asyncio.run(scenario())
    assert codes == {"OK": CALLS}, f"{dict(codes)}"
