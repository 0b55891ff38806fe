"""How many agents one trainerd holds: N simulated agents (asyncio clients in this process) keep
sessions open against a real trainerd (embedded etcd) and heartbeat at 1 Hz.

Prints, per N: heartbeats handled per second beside the offered rate, the coordinator's heartbeat
lag p50/p99 (sent → handled, from its Prometheus histogram), trainerd's CPU, and the nodes falsely
declared LOST. Baseline, measured in the same run: the design trainerd rejected, where every agent
keeps an etcd lease alive at 1 Hz on its own keepalive stream (etcd's CPU and keepalive round trip).

    .venv/bin/python bench/heartbeats.py --agents 1000 2000 5000 --seconds 30
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import random
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import grpc
import psutil
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from proto import trainerd_pb2 as pb  # noqa: E402
from proto import trainerd_pb2_grpc as pb_grpc  # noqa: E402

INTERVAL_S = 1.0
TIMEOUT_S = 5.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(metrics_port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    values = {}
    for line in text.splitlines():
        if line.startswith("trainerd_") and " " in line:
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


def lag_percentile(before: dict, after: dict, q: float) -> float:
    """Upper bucket bound below which fraction q of the heartbeats in the window fell."""
    buckets = []
    for name, value in after.items():
        if name.startswith("trainerd_heartbeat_lag_seconds_bucket"):
            bound = name.split('le="')[1].split('"')[0]
            buckets.append((float("inf") if bound == "+Inf" else float(bound), value - before.get(name, 0.0)))
    buckets.sort()
    total = buckets[-1][1]
    for bound, count in buckets:
        if total and count >= q * total:
            return bound
    return float("nan")


class SimulatedAgents:
    def __init__(self, address: str, count: int, per_channel: int) -> None:
        self._address = address
        self._count = count
        self._per_channel = per_channel
        self.welcomed = 0
        self.failed = 0
        self.failure_codes: collections.Counter[str] = collections.Counter()
        self.sent = 0
        self._tasks: list[asyncio.Task] = []
        self._channels: list[grpc.aio.Channel] = []

    async def start(self, ramp_per_s: float) -> None:
        for i in range(self._count):
            if i % self._per_channel == 0:
                self._channels.append(grpc.aio.insecure_channel(self._address))
            stub = pb_grpc.CoordinatorStub(self._channels[-1])
            self._tasks.append(asyncio.create_task(self._agent(stub, f"sim-{i:05d}")))
            if (i + 1) % 100 == 0:
                await asyncio.sleep(100 / ramp_per_s)

    async def _agent(self, stub, name: str) -> None:
        """Like a real agent: on a broken session, back off briefly and open a new one."""
        welcomed = False
        while True:
            call = stub.Session()
            try:
                await call.write(pb.AgentMessage(hello=pb.Hello(
                    node_name=name, host="127.0.0.1", agent_version="bench",
                    devices=[pb.Device(device_id=0, kind="cpu")])))
                if await call.read() is grpc.aio.EOF:
                    raise ConnectionError("session closed before Welcome")
                if not welcomed:
                    welcomed = True
                    self.welcomed += 1
                await asyncio.sleep(random.uniform(0, INTERVAL_S))  # agents are not in phase
                sequence = 0
                next_at = time.monotonic()
                while True:
                    sequence += 1
                    await call.write(pb.AgentMessage(heartbeat=pb.Heartbeat(sequence=sequence, sent_at=time.time())))
                    self.sent += 1
                    next_at += INTERVAL_S
                    await asyncio.sleep(max(0.0, next_at - time.monotonic()))
            except (grpc.aio.AioRpcError, ConnectionError) as exc:
                self.failed += 1
                reason = f"{exc.code().name}: {exc.details()}" if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
                self.failure_codes[reason[:80]] += 1
                call.cancel()
                await asyncio.sleep(random.uniform(0.1, 0.2))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for channel in self._channels:
            await channel.close()


async def measure(count: int, seconds: float, per_channel: int, workdir: Path) -> dict:
    address = f"127.0.0.1:{free_port()}"
    metrics_port = free_port()
    cluster = {
        "cluster": {
            "name": "bench",
            "coordinator": {"listen": address, "metrics_listen": f"127.0.0.1:{metrics_port}"},
            "etcd": {"data_dir": str(workdir / f"etcd-{count}"), "client_listen": f"127.0.0.1:{free_port()}",
                     "peer_listen": f"127.0.0.1:{free_port()}"},
            "heartbeat": {"interval_s": INTERVAL_S, "timeout_s": TIMEOUT_S},
        }
    }
    cluster_file = workdir / f"cluster-{count}.yaml"
    cluster_file.write_text(yaml.safe_dump(cluster))
    log = open(workdir / f"trainerd-{count}.log", "wb")
    trainerd = subprocess.Popen([str(Path(sys.executable).parent / "trainerd"), "start", "--cluster",
                                 str(cluster_file), "--log-level", "WARNING"], stdout=log, stderr=log)
    try:
        for _ in range(100):
            try:
                if scrape(metrics_port).get("trainerd_is_leader") == 1:
                    break
            except OSError:
                pass
            await asyncio.sleep(0.2)
        agents = SimulatedAgents(address, count, per_channel)
        started = time.monotonic()
        await agents.start(ramp_per_s=1000)
        while agents.welcomed < count and time.monotonic() - started < 120:
            await asyncio.sleep(0.2)
        connect_s = time.monotonic() - started
        await asyncio.sleep(2 * INTERVAL_S)  # settle into steady state
        proc = psutil.Process(trainerd.pid)
        before, cpu_before, t0 = scrape(metrics_port), proc.cpu_times(), time.monotonic()
        await asyncio.sleep(seconds)
        after, cpu_after, t1 = scrape(metrics_port), proc.cpu_times(), time.monotonic()
        window = t1 - t0
        cpu = (cpu_after.user + cpu_after.system - cpu_before.user - cpu_before.system) / window
        with grpc.insecure_channel(address) as channel:
            status = pb_grpc.ControlStub(channel).GetStatus(pb.StatusRequest(), timeout=30)
        # Every simulated agent stayed alive, so every LOST is a false one.
        lost = max(sum(1 for n in status.nodes if n.state == "LOST"),
                   int(after.get("trainerd_nodes_lost_total", 0)))
        await agents.stop()
        return {
            "agents": count,
            "welcomed": agents.welcomed,
            "connect_s": connect_s,
            "offered_per_s": count / INTERVAL_S,
            "handled_per_s": (after["trainerd_heartbeats_total"] - before["trainerd_heartbeats_total"]) / window,
            "lag_p50_s": lag_percentile(before, after, 0.50),
            "lag_p99_s": lag_percentile(before, after, 0.99),
            "cpu_cores": cpu,
            "false_lost": lost,
            "session_failures": agents.failed,
            "failure_codes": dict(agents.failure_codes),
        }
    finally:
        trainerd.terminate()
        try:
            trainerd.wait(30)
        except subprocess.TimeoutExpired:
            trainerd.kill()
        log.close()


async def etcd_lease_baseline(count: int, seconds: float, workdir: Path) -> dict:
    """N leases, each refreshed once a second on its own LeaseKeepAlive stream, against a fresh etcd."""
    from aetcd import rpc

    from daemon.etcd_process import EmbeddedEtcd

    etcd = EmbeddedEtcd(workdir / f"baseline-etcd-{count}", free_port(), free_port())
    await etcd.start()
    channel = grpc.aio.insecure_channel(etcd.endpoint)
    stub = rpc.LeaseStub(channel)
    round_trips: list[float] = []
    measuring = False
    lost = 0

    async def keep_alive() -> None:
        nonlocal lost
        lease = await stub.LeaseGrant(rpc.LeaseGrantRequest(TTL=int(TIMEOUT_S)))
        call = stub.LeaseKeepAlive()
        await asyncio.sleep(random.uniform(0, INTERVAL_S))
        next_at = time.monotonic()
        while True:
            sent = time.monotonic()
            await call.write(rpc.LeaseKeepAliveRequest(ID=lease.ID))
            reply = await call.read()
            if reply.TTL <= 0:
                lost += 1
                return
            if measuring:
                round_trips.append(time.monotonic() - sent)
            next_at += INTERVAL_S
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))

    tasks = []
    try:
        for i in range(count):
            tasks.append(asyncio.create_task(keep_alive()))
            if (i + 1) % 100 == 0:
                await asyncio.sleep(0.1)
        await asyncio.sleep(2 * INTERVAL_S)
        proc = psutil.Process(etcd._process.pid)
        cpu_before, t0 = proc.cpu_times(), time.monotonic()
        measuring = True
        await asyncio.sleep(seconds)
        measuring = False
        cpu_after, window = proc.cpu_times(), time.monotonic() - t0
        round_trips.sort()
        pick = (lambda q: round_trips[min(len(round_trips) - 1, int(q * len(round_trips)))]) if round_trips else (
            lambda q: float("nan"))
        return {"per_s": len(round_trips) / window, "p50": pick(0.5), "p99": pick(0.99), "lost": lost,
                "cpu": (cpu_after.user + cpu_after.system - cpu_before.user - cpu_before.system) / window}
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await channel.close()
        await etcd.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--agents", type=int, nargs="+", default=[1000, 2000, 5000])
    parser.add_argument("--seconds", type=float, default=30.0, help="measurement window per N")
    parser.add_argument("--agents-per-channel", type=int, default=1,
                        help="simulated agents sharing one TCP connection (1: one each, like real hosts)")
    args = parser.parse_args()
    print(f"heartbeat interval {INTERVAL_S}s, LOST after {TIMEOUT_S}s; window {args.seconds:.0f}s per row")
    header = (f"{'agents':>7} {'welcomed':>8} {'connect':>8} {'offered/s':>10} {'handled/s':>10} "
              f"{'ratio':>6} {'lag p50':>8} {'lag p99':>8} {'trainerd cpu':>12} {'false LOST':>10} {'reconnects':>10}")
    print(header)
    asyncio.run(run_all(args))


async def run_all(args) -> None:
    """One event loop for every row: gRPC's poller must not outlive the loop it was started on."""
    with tempfile.TemporaryDirectory(prefix="trainerd-bench-") as tmp:
        for count in args.agents:
            r = await measure(count, args.seconds, args.agents_per_channel, Path(tmp))
            print(f"{r['agents']:>7} {r['welcomed']:>8} {r['connect_s']:>7.1f}s {r['offered_per_s']:>10.0f} "
                  f"{r['handled_per_s']:>10.0f} {r['handled_per_s'] / r['offered_per_s']:>6.3f} "
                  f"{r['lag_p50_s'] * 1000:>6.1f}ms {r['lag_p99_s'] * 1000:>6.1f}ms "
                  f"{r['cpu_cores'] * 100:>10.0f}% {r['false_lost']:>10} {r['session_failures']:>10}", flush=True)
            for reason, n in r["failure_codes"].items():
                print(f"        {n} session(s) broke and were re-opened: {reason}", flush=True)
            b = await etcd_lease_baseline(count, args.seconds, Path(tmp))
            print(f"{'  baseline, etcd leases at 1 Hz (round trip, etcd cpu, leases lost):':<44} "
                  f"{b['per_s']:>10.0f} {b['per_s'] / count:>6.3f} {b['p50'] * 1000:>6.1f}ms {b['p99'] * 1000:>6.1f}ms "
                  f"{b['cpu'] * 100:>10.0f}% {b['lost']:>10}", flush=True)


if __name__ == "__main__":
    main()
