"""How many agents one trainerd holds: N simulated agents keep sessions open against a real trainerd
(and a real etcd) and heartbeat at the pace it names (1 Hz until heartbeat.max_per_s would be
exceeded: daemon/heartbeat_pace.py), all connecting at once unless --ramp spreads them.

Each simulated agent is the real agent's session code (agent/session.py CoordinatorLink: its own TCP
connection, Welcome timeout, jittered backoff, resume token, the coordinator's retry-after hint); only
the processes it would supervise are missing. They run in --client-processes processes so the client
side is not one Python thread. trainerd has to share the machine's cores with them: its CPU share is
printed.

Prints, per N: time until every agent was welcomed, heartbeats handled per second beside the offered
rate (at the pace in force, its interval printed), the coordinator's heartbeat lag p50/p99 (sent ->
handled, from its Prometheus histogram), trainerd's CPU, the nodes falsely declared LOST, sessions
that broke after their Welcome, and Hellos the coordinator deferred (RESOURCE_EXHAUSTED with a
retry-after hint: not a broken session, the agent had none yet). With --failover, a standby trainerd
runs beside the leader; after the window the leader is killed and the bench measures how long until
every agent is connected again (to the new leader), and the false LOST. Baseline (--baseline),
measured in the same run: the design trainerd rejected, where every agent keeps an etcd lease alive
at 1 Hz on its own keepalive stream. Each N runs once per --max-per-s value and --max-opening value,
each row on an etcd and in a directory of its own; the default --max-per-s pair puts the coordinator's
default (2000) beside pacing off (1e9), the same code without the feature, and --max-opening 256 1000000
puts the opening gate's default beside it off.

What keeps a burst from breaking sessions (docs/operations/scaling.md; every run in
bench/heartbeats.md): trainerd and the simulated agents run gRPC with its iomgr TCP endpoints, not its
EventEngine ones (fewer streams go silent: common/grpc_core_settings.py); the gRPC core holds every call that
waits for the coordinator's event loop instead of cancelling those past 1,000 (daemon/app.py
call_backlog_options); at most 256 sessions are opened at once, the agents past that told when to come back,
each at a turn of its own, and counted in the pace by their tickets (daemon/admission.py OpeningGate), which
holds a reserve of two steps while any wait (daemon/heartbeat_pace.py); Hellos that write to etcd are admitted
64 at a time and deferred with a retry-after hint beyond 2 s of queue (HelloAdmission); the leader lease is
refreshed by a thread of its own (daemon/store/lease_keeper.py); liveness deadlines allow for the leader's own
read lag (daemon/read_lag.py); the garbage collector leaves the start-up heap alone and runs rarely
(daemon/app.py settle_gc_for_serving); a deferred agent comes back on the connection it was deferred on, and an
agent waits 60 s for each Welcome, as long as keepalive finds the coordinator alive (agent/session.py); a node
whose agent gave up its Hello just as it was welcomed gets two of the agent's next Welcome waits before it is
LOST (daemon/coordinator.py close_session). --trace shows one node's sessions on both sides. An agent redials
after max(3 intervals, timeout/2) without an ack, so a coordinator that falls that far behind shows up here as
broken sessions.

trainerd may open at most as many files as the machine allows (20,000 where the reference figures were
taken, and it could not be raised): for 20,000 agents, two share each TCP connection
(--agents-per-connection 2), as 10,000 hosts with two agents each would. Run it alone on the machine
(`flock` the shared lock): the clients take cores from trainerd and the figures show the load average.

    .venv/bin/python bench/heartbeats.py --agents 2000 5000 --seconds 15 --baseline
    .venv/bin/python bench/heartbeats.py --agents 10000 --seconds 20 --failover --baseline
    .venv/bin/python bench/heartbeats.py --agents 20000 --agents-per-connection 2 --seconds 20
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextvars
import itertools
import logging
import math
import multiprocessing
import os
import random
import re
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import psutil
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from agent.commands import Command  # noqa: E402
from agent.session import CoordinatorLink  # noqa: E402
from bench import grpc_sockets  # noqa: E402
from common import grpc_core_settings  # noqa: E402
from common.clock import SystemClock  # noqa: E402
from daemon.etcd_process import EmbeddedEtcd  # noqa: E402
from proto import trainerd_pb2 as pb  # noqa: E402
from proto import trainerd_pb2_grpc as pb_grpc  # noqa: E402

INTERVAL_S = 1.0
TIMEOUT_S = 5.0
REPORT_EVERY_S = 0.25


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def raise_file_limit(wanted: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, wanted), max(hard, wanted)))
    except (ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        print(f"note: could not raise the open-file limit to {wanted} (stays {hard})", file=sys.stderr)


def scrape(metrics_port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    values = {}
    for line in text.splitlines():
        if line.startswith("trainerd_") and " " in line:
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


def _buckets(metrics: dict, histogram: str) -> list[tuple[float, float]]:
    """A histogram's cumulative (upper bound, count) pairs, in order."""
    buckets = []
    for name, value in metrics.items():
        if name.startswith(f"{histogram}_bucket"):
            bound = name.split('le="')[1].split('"')[0]
            buckets.append((float("inf") if bound == "+Inf" else float(bound), value))
    return sorted(buckets)


def histogram_max(metrics: dict, histogram: str) -> float:
    """The upper bound of the highest bucket any observation fell in (0: none observed)."""
    buckets = _buckets(metrics, histogram)
    total = buckets[-1][1] if buckets else 0
    return next((bound for bound, count in buckets if total and count >= total), 0.0)


def histogram_over(metrics: dict, histogram: str, limit: float) -> int:
    """How many observations were above `limit`, a bucket's upper bound."""
    buckets = _buckets(metrics, histogram)
    at_most = max((count for bound, count in buckets if bound <= limit), default=0.0)
    return int((buckets[-1][1] if buckets else 0) - at_most)


def lag_percentile(before: dict, after: dict, q: float) -> float:
    """Upper bucket bound below which fraction q of the heartbeats in the window fell."""
    earlier = dict(_buckets(before, "trainerd_heartbeat_lag_seconds"))
    buckets = [(bound, count - earlier.get(bound, 0.0)) for bound, count in
               _buckets(after, "trainerd_heartbeat_lag_seconds")]
    total = buckets[-1][1] if buckets else 0.0
    for bound, count in buckets:
        if total and count >= q * total:
            return bound
    return float("nan")


# ------------------------------------------------------------------ client processes


class MemoryIdentity:
    """The resume token, kept in memory (a real agent keeps it in a file)."""

    def __init__(self) -> None:
        self._token = ""

    def load_token(self, node_name: str) -> str:
        return self._token

    def save_token(self, node_name: str, token: str) -> None:
        self._token = token


class Tally:
    """What one client process saw; sent to the bench as a dict."""

    def __init__(self) -> None:
        self.welcomed = 0  # agents welcomed at least once
        self.connected = 0  # agents with a session now
        self.broken = 0  # sessions that ended after their Welcome
        self.reasons: collections.Counter[str] = collections.Counter()  # why sessions broke
        self.deferred = 0  # Hellos answered RESOURCE_EXHAUSTED (no session yet)
        self.refused: collections.Counter[str] = collections.Counter()  # other failed attempts
        self.heartbeats_sent = 0  # heartbeats its agents wrote
        self.acks = 0  # acks its agents read
        self.acks_late = 0  # of them, read more than LATE_ACK_S after their heartbeat was written
        self.ack_round_trip_max_s = 0.0
        self.writes_slow = 0  # stream writes that took more than LATE_ACK_S to complete
        self.write_max_s = 0.0  # the longest a stream write took (or has been waiting, when reported)
        self.writes_waiting: dict[int, float] = {}  # agent -> when its write in flight began (one per stream)
        self.loop_lag_max_s = 0.0  # the most this process's event loop ran late
        self.loop_late_s = 0.0  # seconds its loop ran late by more than LATE_LOOP_S, in all


LATE_ACK_S = 3.0


class SimulatedAgent:
    """The agent's SessionHandler with nothing to supervise: its heartbeat carries only `sent_at`. It also
    times each heartbeat's round trip (`acked`, fed from the link): set beside the coordinator's own
    handling lag, that tells an ack answered late from one that travelled back late."""

    def __init__(self, tally: Tally) -> None:
        self._tally = tally
        self._welcomed = False
        self._sent: collections.deque[float] = collections.deque(maxlen=64)  # this session's, by sequence
        self._sequence = 0  # of the newest heartbeat in _sent

    def acked(self, sequence: int) -> None:
        back = self._sequence - sequence  # how many heartbeats later than the acked one
        if 0 <= back < len(self._sent):
            round_trip = time.monotonic() - self._sent[-1 - back]
            self._tally.acks += 1
            self._tally.acks_late += round_trip > LATE_ACK_S
            self._tally.ack_round_trip_max_s = max(self._tally.ack_round_trip_max_s, round_trip)

    def on_command(self, command: Command) -> None:
        pass

    def heartbeat_body(self) -> pb.Heartbeat:
        self._tally.heartbeats_sent += 1
        self._sequence += 1  # the link numbers a session's heartbeats 1, 2, ... in the order it asks for them
        self._sent.append(time.monotonic())
        return pb.Heartbeat(sent_at=time.time())

    def on_connected(self, connected: bool) -> None:
        self._sent.clear()
        self._sequence = 0
        if connected:
            self._tally.connected += 1
            if not self._welcomed:
                self._welcomed = True
                self._tally.welcomed += 1
        else:
            self._tally.connected -= 1
            self._tally.broken += 1


PLACEHOLDER = re.compile(r"%[-#0 +]*\d*(?:\.\d+)?[sdfr]")
AGENT_NAME = re.compile(r"sim-\d+")  # a failure's text names its agent: counted by its form


class CountFailures(logging.Handler):
    """Reads the link's own warnings: why a session broke, or why an attempt failed."""

    def __init__(self, tally: Tally) -> None:
        super().__init__(logging.INFO)
        self._tally = tally

    def emit(self, record: logging.LogRecord) -> None:
        """Counts `record`. Whatever goes wrong here is reported, never raised: an exception out of a handler
        ends the simulated agent that logged (until 2026-11-28 one did, for every two-argument "broke"
        message, and the bench counted those agents as lost at a failover)."""
        try:
            self._count(record)
        except Exception:
            self.handleError(record)

    def _count(self, record: logging.LogRecord) -> None:
        msg, args = record.msg, record.args or ()
        if msg.startswith("session with %s broke"):  # the error's code and details, or an InvalidStateError
            self._tally.reasons[AGENT_NAME.sub("sim-…", ": ".join(str(a) for a in args[1:]))[:80]] += 1
        elif msg.startswith("no answer from the coordinator"):
            # How long the agent had waited: the redial time of the pace in force (3 s at the 1 s pace).
            waited = f"{math.floor(float(args[0]))}-{math.floor(float(args[0])) + 1}s" if args else "?"
            # Emitted on the agent's own task: a write of its still waiting means the heartbeats never left.
            writing = self._tally.writes_waiting.get(AGENT.get())
            stuck = (f"its stream write waiting {math.floor(time.monotonic() - writing)}s+" if writing is not None
                     else "no write waiting")
            self._tally.reasons[f"heartbeats unanswered for {waited}, {stuck}"] += 1
        elif msg.startswith("session with %s failed"):
            if args[1] == "RESOURCE_EXHAUSTED":
                self._tally.deferred += 1
            else:
                self._tally.refused[AGENT_NAME.sub("sim-…", f"{args[1]}: {args[2]}")[:80]] += 1
        elif (msg.startswith("session with %s ended") or msg.startswith("registered as")
              or msg.startswith("the coordinator asks for a heartbeat every")):
            pass
        elif msg.startswith("the link stopped for good"):
            self._tally.reasons[f"the link stopped for good: {type(args[0]).__name__}"] += 1
        elif msg.startswith("%s is a standby"):
            self._tally.refused["UNAVAILABLE: a standby named the leader"] += 1
        else:  # the message's form, not its text (addresses, seconds): a report to the bench stays small
            self._tally.refused[PLACEHOLDER.sub("…", msg)[:80]] += 1


CONNECTION = contextvars.ContextVar("CONNECTION", default=0)
AGENT = contextvars.ContextVar("AGENT", default=0)  # which simulated agent a task (and its log records) serves


def time_stream_writes(tally: Tally) -> None:
    """Times every stream write of this process's agents (Hello, heartbeats, reports): a write that does not
    complete holds the agent's heartbeats back, so its session goes silent without any loop being late."""
    from grpc.aio._call import StreamStreamCall

    write = StreamStreamCall.write

    async def timed_write(self, request) -> None:
        started, agent = time.monotonic(), AGENT.get()
        tally.writes_waiting[agent] = started
        try:
            await write(self, request)
        finally:
            if tally.writes_waiting.get(agent) == started:
                del tally.writes_waiting[agent]
            took = time.monotonic() - started
            tally.write_max_s = max(tally.write_max_s, took)
            tally.writes_slow += took > LATE_ACK_S

    StreamStreamCall.write = timed_write  # type: ignore[method-assign]


def one_connection_per_group() -> None:
    """gRPC shares one TCP connection between channels of the same process with the same arguments;
    real agents are separate hosts. A channel argument naming the agent's group (each agent its own,
    unless --agents-per-connection) gives each group its own connection."""
    plain = grpc.aio.insecure_channel

    def insecure_channel(target, options=None, *args, **kwargs):
        # The agent asks for a connection of its own per channel; here the group's channels share one.
        shared = [option for option in options or [] if option[0] != "grpc.use_local_subchannel_pool"]
        return plain(target, [*shared, ("trainerd.bench.connection", CONNECTION.get())], *args, **kwargs)

    grpc.aio.insecure_channel = insecure_channel  # type: ignore[assignment]


class TraceLines(logging.Filter):
    """What --trace writes: each of the link's log records with its simulated agent's name (the link's messages
    name the address only), the pace changes left out."""

    def __init__(self, names: list[str]) -> None:
        super().__init__()
        self._names = names

    def filter(self, record: logging.LogRecord) -> bool:
        """The pace changes are most of the lines, and writing them starved the clients."""
        record.agent = self._names[AGENT.get()]
        return not record.msg.startswith("the coordinator asks for a heartbeat every")


def client_process(addresses: list[str], names: list[str], ramp_per_s: float, per_connection: int, nice: int,
                   channelz: Path | None, trace: Path | None, report, stop) -> None:
    if channelz is not None:
        grpc_sockets.dump_on_signal(channelz, "client")
    os.nice(nice)
    raise_file_limit(len(names) // per_connection + 1000)
    one_connection_per_group()
    tally = Tally()
    time_stream_writes(tally)
    session_log = logging.getLogger("agent.session")
    session_log.setLevel(logging.INFO)
    session_log.propagate = False
    session_log.addHandler(CountFailures(tally))
    if trace is not None:
        to_file = logging.FileHandler(trace)
        to_file.addFilter(TraceLines(names))
        to_file.setFormatter(logging.Formatter("%(asctime)s %(agent)s %(levelname)s %(message)s"))
        session_log.addHandler(to_file)
    asyncio.run(_run_agents(addresses, names, ramp_per_s, per_connection, tally, report, stop))


LOOP_PROBE_S = 0.1
LATE_LOOP_S = 1.0


async def _watch_loop_lag(tally: Tally) -> None:
    """How late this client's event loop runs: a simulated agent's ack is read, and its silence judged, only
    when the loop gets to it, so a late client loop breaks sessions that the coordinator answered in time."""
    loop = asyncio.get_running_loop()
    while True:
        started = loop.time()
        await asyncio.sleep(LOOP_PROBE_S)
        late = loop.time() - started - LOOP_PROBE_S
        tally.loop_lag_max_s = max(tally.loop_lag_max_s, late)
        if late > LATE_LOOP_S:
            tally.loop_late_s += late


def _timing_acks(follow_pace, agent: SimulatedAgent):
    """The link's handling of an ack (agent/session.py `_follow_pace`), also timing the round trip."""

    def follow(ack: pb.HeartbeatAck) -> None:
        agent.acked(ack.sequence)
        follow_pace(ack)

    return follow


async def _run_link(link: CoordinatorLink, agent: SimulatedAgent, stop) -> None:
    """The link's run, which returns only when the bench cancels it: anything else ending it is reported."""
    try:
        await link.run(agent)
    except BaseException as exc:
        if not stop.is_set():
            logging.getLogger("agent.session").error("the link stopped for good: %r", exc, exc_info=True)
        raise


async def _run_agents(addresses, names, ramp_per_s, per_connection: int, tally: Tally, report, stop) -> None:
    clock, tasks = SystemClock(), [asyncio.create_task(_watch_loop_lag(tally))]
    for i, name in enumerate(names):
        CONNECTION.set(i // per_connection)  # the task made next copies both
        AGENT.set(i)
        link = CoordinatorLink(addresses=addresses, identity=MemoryIdentity(), clock=clock,  # type: ignore[arg-type]
                               rng=random.Random(name), hello=pb.Hello(
                                   node_name=name, host="127.0.0.1", agent_version="bench",
                                   devices=[pb.Device(device_id=0, kind="cpu")]))
        agent = SimulatedAgent(tally)
        link._follow_pace = _timing_acks(link._follow_pace, agent)  # type: ignore[method-assign]
        tasks.append(asyncio.create_task(_run_link(link, agent, stop)))
        if (i + 1) % 100 == 0:
            await asyncio.sleep(100 / ramp_per_s)
    while not stop.is_set():
        report.send({"welcomed": tally.welcomed, "connected": tally.connected, "broken": tally.broken,
                     "reasons": dict(tally.reasons), "deferred": tally.deferred, "refused": dict(tally.refused),
                     "loop_lag_max_s": tally.loop_lag_max_s, "loop_late_s": tally.loop_late_s,
                     "heartbeats_sent": tally.heartbeats_sent, "acks": tally.acks, "acks_late": tally.acks_late,
                     "ack_round_trip_max_s": tally.ack_round_trip_max_s, "writes_slow": tally.writes_slow,
                     "write_max_s": max([tally.write_max_s] + [time.monotonic() - started for started
                                                               in tally.writes_waiting.values()])})
        await asyncio.sleep(REPORT_EVERY_S)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


class Clients:
    """The simulated agents, spread over processes; `totals()` sums what they last reported."""

    def __init__(self, addresses: list[str], count: int, processes: int, ramp_per_s: float,
                 per_connection: int, nice: int = 0, channelz: Path | None = None,
                 trace: Path | None = None) -> None:
        context = multiprocessing.get_context("spawn")
        self._stop = context.Event()
        self._pipes, self._procs, self._last = [], [], []
        self._lock = threading.Lock()
        names = [f"sim-{i:05d}" for i in range(count)]
        for p in range(processes):
            mine, theirs = context.Pipe(duplex=False)
            proc = context.Process(target=client_process, daemon=True, args=(
                addresses, names[p::processes], ramp_per_s / processes, per_connection, nice, channelz,
                None if trace is None else trace / f"clients-{p}.log", theirs, self._stop))
            proc.start()
            self._pipes.append(mine)
            self._procs.append(proc)
            self._last.append({})
        threading.Thread(target=self._drain, name="client reports", daemon=True).start()

    def _drain(self) -> None:
        """Read the client processes' reports as they come. A client's `report.send` blocks its event
        loop, and with it every agent it runs, whenever the pipe is full: left unread through a
        measurement window, the pipe froze the agents and the window showed no heartbeat handled."""
        while not self._stop.is_set():
            for i, pipe in enumerate(self._pipes):
                try:
                    while pipe.poll():
                        report = pipe.recv()
                        with self._lock:
                            self._last[i] = report
                except (EOFError, OSError):
                    continue
            time.sleep(0.05)

    def totals(self) -> dict:
        with self._lock:
            last_reports = list(self._last)
        total: dict = {"welcomed": 0, "connected": 0, "broken": 0, "deferred": 0, "loop_late_s": 0.0,
                       "heartbeats_sent": 0, "acks": 0, "acks_late": 0, "loop_lag_max_s": 0.0,
                       "ack_round_trip_max_s": 0.0, "writes_slow": 0, "write_max_s": 0.0,
                       "reasons": collections.Counter(),
                       "refused": collections.Counter()}
        for last in last_reports:
            for key in ("welcomed", "connected", "broken", "deferred", "loop_late_s", "heartbeats_sent", "acks",
                        "acks_late", "writes_slow"):
                total[key] += last.get(key, 0)
            for key in ("loop_lag_max_s", "ack_round_trip_max_s", "write_max_s"):
                total[key] = max(total.get(key, 0.0), last.get(key, 0.0))
            total["reasons"].update(last.get("reasons", {}))
            total["refused"].update(last.get("refused", {}))
        return total

    def pids(self) -> list[int]:
        """The client processes, once every one has reported (so is past installing its signal handler)."""
        with self._lock:
            return [proc.pid for proc in self._procs] if all(self._last) else []

    def cpu_seconds(self) -> float:
        used = 0.0
        for proc in self._procs:
            try:
                times = psutil.Process(proc.pid).cpu_times()
                used += times.user + times.system
            except psutil.NoSuchProcess:
                pass
        return used

    def stop(self) -> None:
        self._stop.set()
        for proc in self._procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()


# ------------------------------------------------------------------ trainerd


class Trainerd:
    def __init__(self, workdir: Path, name: str, etcd_endpoint: str, max_sessions: int, max_per_s: float,
                 max_opening: int, channelz: Path | None = None, log_level: str = "WARNING") -> None:
        self.address = f"127.0.0.1:{free_port()}"
        self.metrics_port = free_port()
        cluster = {"cluster": {
            "name": "bench",
            "coordinator": {"listen": self.address, "metrics_listen": f"127.0.0.1:{self.metrics_port}",
                            "max_sessions": max_sessions, "max_opening_sessions": max_opening},
            "etcd": {"endpoints": [etcd_endpoint]},
            "heartbeat": {"interval_s": INTERVAL_S, "timeout_s": TIMEOUT_S, "max_per_s": max_per_s},
        }}
        cluster_file = workdir / f"cluster-{name}.yaml"
        cluster_file.write_text(yaml.safe_dump(cluster))
        self._log = open(workdir / f"trainerd-{name}.log", "wb")
        # With --channelz, through a wrapper that records its connections at every SIGUSR2.
        command = [str(Path(sys.executable).parent / "trainerd")] if channelz is None else [
            sys.executable, str(REPO / "bench" / "channelz_trainerd.py"), str(channelz)]
        self.process = subprocess.Popen(
            [*command, "start", "--cluster", str(cluster_file), "--log-level", log_level],
            stdout=self._log, stderr=self._log)

    def metrics(self) -> dict[str, float]:
        return scrape(self.metrics_port)

    def leads(self) -> bool:
        try:
            return self.metrics().get("trainerd_is_leader") == 1
        except OSError:
            return False

    def false_lost(self) -> int:
        """Every simulated agent stayed alive, so every LOST is a false one."""
        with grpc.insecure_channel(self.address) as channel:
            status = pb_grpc.ControlStub(channel).GetStatus(pb.StatusRequest(), timeout=60)
        return max(sum(1 for n in status.nodes if n.state == "LOST"),
                   int(self.metrics().get("trainerd_nodes_lost_total", 0)))

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()


async def wait_until(predicate, limit_s: float, step_s: float = 0.1) -> float:
    """Seconds until `predicate()` held (limit_s when it never did)."""
    started = time.monotonic()
    while time.monotonic() - started < limit_s:
        if predicate():
            return time.monotonic() - started
        await asyncio.sleep(step_s)
    return limit_s


async def measure(count: int, max_per_s: float, max_opening: int, args, workdir: Path) -> dict:
    etcd = EmbeddedEtcd(workdir / f"etcd-{count}", free_port(), free_port())
    await etcd.start()
    coordinators: list[Trainerd] = []
    clients = recording = None
    try:
        max_sessions = count + 1000
        records = channelz = None
        if args.queues_every:
            records = workdir / "connections"
            records.mkdir()
            channelz = records if args.channelz else None
        log_level = "INFO" if args.trace else "WARNING"
        coordinators.append(Trainerd(workdir, f"{count}-a", etcd.endpoint, max_sessions, max_per_s,
                                     max_opening, channelz, log_level))
        await wait_until(coordinators[0].leads, 30, 0.2)
        if args.failover:
            coordinators.append(Trainerd(workdir, f"{count}-b", etcd.endpoint, max_sessions, max_per_s,
                                         max_opening, log_level=log_level))
            await asyncio.sleep(2)  # standing by
        leader = coordinators[0]
        clients = Clients([c.address for c in coordinators], count, args.client_processes, args.ramp,
                          args.agents_per_connection, args.client_nice, channelz,
                          workdir if args.trace else None)
        started = time.monotonic()
        recording = None if records is None else asyncio.create_task(
            record_connections(leader, clients, records, args.queues_every, channelz is not None))
        connect_s = await wait_until(lambda: clients.totals()["welcomed"] >= count, args.connect_limit)
        await asyncio.sleep(2 * leader.metrics().get("trainerd_heartbeat_interval_seconds", INTERVAL_S))  # settle
        proc = psutil.Process(leader.process.pid)
        before, cpu_before, client_cpu_before, t0 = leader.metrics(), proc.cpu_times(), clients.cpu_seconds(), \
            time.monotonic()
        broken_before_window, sent_before_window = clients.totals()["broken"], clients.totals()["heartbeats_sent"]
        window_started = time.time()
        await asyncio.sleep(args.seconds)
        after, cpu_after, client_cpu_after, t1 = leader.metrics(), proc.cpu_times(), clients.cpu_seconds(), \
            time.monotonic()
        window = t1 - t0
        interval_s = after.get("trainerd_heartbeat_interval_seconds", INTERVAL_S)
        result = {
            "agents": count,
            "max_per_s": max_per_s,
            "interval_s": interval_s,
            "connect_s": connect_s,
            "offered_per_s": count / interval_s,
            "handled_per_s": (after["trainerd_heartbeats_total"] - before["trainerd_heartbeats_total"]) / window,
            "lag_p50_s": lag_percentile(before, after, 0.50),
            "lag_p99_s": lag_percentile(before, after, 0.99),
            "run_lag_p99_s": lag_percentile({}, after, 0.99),  # from the coordinator's start, connects included
            "run_lag_max_s": histogram_max(after, "trainerd_heartbeat_lag_seconds"),
            "ack_write_max_s": histogram_max(after, "trainerd_heartbeat_ack_write_seconds"),
            "ack_writes_slow": histogram_over(after, "trainerd_heartbeat_ack_write_seconds", 2.0),
            "end_heard": _buckets(after, "trainerd_session_end_heard_seconds"),
            "ack_writes_waiting": after.get("trainerd_heartbeat_ack_writes_waiting", 0.0),
            "cpu_cores": (cpu_after.user + cpu_after.system - cpu_before.user - cpu_before.system) / window,
            "client_cpu_cores": (client_cpu_after - client_cpu_before) / window,
            "false_lost": leader.false_lost(),
            "lost_leadership": int(after.get("trainerd_is_leader", 0) != 1),
            "stall_s": after.get("trainerd_coordinator_stall_seconds_total", 0.0),
            "pass_max_s": histogram_max(after, "trainerd_coordinator_pass_seconds"),
            "passes_slow": histogram_over(after, "trainerd_coordinator_pass_seconds", 1.0),
            "elapsed_s": time.monotonic() - started,
        }
        result.update(clients.totals())
        if recording is not None and records is not None:
            recording.cancel()
            await asyncio.gather(recording, return_exceptions=True)
            recording = None
            result["connections"] = (grpc_sockets.unread_queues(records, args.queues_every)
                                     + grpc_sockets.wire_silence(records, args.queues_every, 2 * interval_s,
                                                                 window_started))
            if channelz is not None:
                result["connections"] += grpc_sockets.silent_streams(channelz, args.queues_every)
        result["broken_in_window"] = result["broken"] - broken_before_window
        result["sent_per_s"] = (result["heartbeats_sent"] - sent_before_window) / window
        if args.failover:
            result["failover"] = await failover(coordinators, clients, count, TIMEOUT_S * interval_s / INTERVAL_S)
        return result
    finally:
        if recording is not None:
            recording.cancel()
        if clients is not None:
            clients.stop()
        for coordinator in coordinators:
            coordinator.stop()
        await etcd.stop()


async def record_connections(leader: Trainerd, clients: Clients, directory: Path, every_s: float,
                             channelz: bool) -> None:
    """Every `every_s` seconds, take the kernel's queues of every connection to trainerd; with `channelz`,
    have trainerd and every client process record gRPC's view of theirs at the same moment
    (bench/grpc_sockets.py)."""
    port = int(leader.address.rsplit(":", 1)[1])
    while channelz and not clients.pids():
        await asyncio.sleep(0.1)
    for round_number in itertools.count():
        await asyncio.sleep(every_s)
        if channelz:
            for pid in (leader.process.pid, *clients.pids()):
                os.kill(pid, signal.SIGUSR2)
        grpc_sockets.save_kernel_queues(directory / f"kernel-{round_number}.json", port)


async def failover(coordinators: list[Trainerd], clients: Clients, count: int, timeout_s: float) -> dict:
    """Kill the leader; time until the standby leads and until every agent has a session with it."""
    leader, standby = coordinators
    broken_before = clients.totals()["broken"]
    leader.process.send_signal(signal.SIGKILL)
    killed = time.monotonic()
    await wait_until(standby.leads, 60, 0.1)
    leads_s = time.monotonic() - killed
    everyone_back = await wait_until(lambda: clients.totals()["connected"] >= count, 120, 0.1) < 120
    all_back_s = time.monotonic() - killed if everyone_back else float("inf")
    await asyncio.sleep(timeout_s + 1)  # long enough for any LOST to be declared (at the pace in force)
    totals = clients.totals()
    return {"leads_s": leads_s, "all_back_s": all_back_s,
            "false_lost": standby.false_lost(), "broken": totals["broken"] - broken_before,
            "connected": totals["connected"]}


async def etcd_lease_baseline(count: int, seconds: float, workdir: Path) -> dict:
    """N leases, each refreshed once a second on its own LeaseKeepAlive stream, against a fresh etcd."""
    from aetcd import rpc

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
    parser.add_argument("--max-per-s", type=float, nargs="+", default=[2000.0, 1e9],
                        help="heartbeat.max_per_s, a row per value; the default's second, 1e9, never stretches "
                             "the pace: the same code with pacing off, the baseline")
    parser.add_argument("--max-opening", type=int, nargs="+", default=[256],
                        help="cluster.coordinator.max_opening_sessions, a row per value (and per --max-per-s); "
                             "1000000 never defers a Hello before it is welcomed: the gate off")
    parser.add_argument("--client-processes", type=int, default=4,
                        help="processes the simulated agents are spread over (at 10,000 agents in 2, their gRPC "
                             "left bytes unread in the kernel for 2 s and more on 5,040 connections, and the "
                             "bench measured its own clients; in 4, on 0-247: --queues-every shows it)")
    parser.add_argument("--agents-per-connection", type=int, default=1,
                        help="simulated agents sharing one TCP connection (1: one each, like real hosts; "
                             "2 for 20,000 agents when trainerd may open only 20,000 files)")
    parser.add_argument("--client-nice", type=int, default=0,
                        help="niceness of the client processes: they stand in for other hosts, so with e.g. 10 "
                             "trainerd gets the cores first, as on a host of its own")
    parser.add_argument("--ramp", type=float, default=1e9,
                        help="agents started per second (default: all at once)")
    parser.add_argument("--connect-limit", type=float, default=180.0, help="seconds to wait for every Welcome")
    parser.add_argument("--failover", action="store_true",
                        help="run a standby, kill the leader after the window, time the agents' return")
    parser.add_argument("--baseline", action="store_true", help="also measure one etcd lease per agent")
    parser.add_argument("--queues-every", type=float, metavar="S",
                        help="a probe: every S seconds, record the kernel's receive and send queues of every "
                             "connection to trainerd (`ss`, nothing in the processes measured) and print how long "
                             "bytes waited unread on each side (bench/grpc_sockets.py)")
    parser.add_argument("--channelz", action="store_true",
                        help="with --queues-every, trainerd and the clients also record gRPC's own view of their "
                             "connections, and the streams that delivered nothing are told by where their messages "
                             "were; it stalls each process for seconds, so the row's other figures are not "
                             "comparable")
    parser.add_argument("--keep-logs", type=Path, metavar="DIR",
                        help="run in DIR and keep trainerd's logs there (default: a temporary folder)")
    parser.add_argument("--trace", action="store_true",
                        help="with --keep-logs, trainerd logs at INFO (every session's end and every event, LOST "
                             "included) and each client process writes its agents' session log, each line naming "
                             "its agent, to clients-P.log: to follow one node's sessions on both sides. The "
                             "logging costs both sides CPU, so the row's other figures are not comparable")
    args = parser.parse_args()
    if args.trace and args.keep_logs is None:
        parser.error("--trace writes its logs where --keep-logs keeps them: give both")
    if args.channelz and not args.queues_every:
        parser.error("--channelz records at the moments --queues-every sets: give both")
    # The client processes (started after this) run gRPC's core as trainerd-agent does: it reads this as
    # they import grpc. trainerd applies it itself.
    os.environ.setdefault("GRPC_EXPERIMENTS", grpc_core_settings.GRPC_EXPERIMENTS)
    raise_file_limit(max(args.agents) // args.agents_per_connection + 1000)
    print(f"heartbeat interval {INTERVAL_S}s, LOST after {TIMEOUT_S}s, both stretched past max/s; "
          f"window {args.seconds:.0f}s per row; "
          f"{args.client_processes} client processes (nice {args.client_nice}), {args.agents_per_connection} agent(s) "
          f"per TCP connection; "
          f"{os.cpu_count()} cores, load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}; "
          f"GRPC_EXPERIMENTS={os.environ.get('GRPC_EXPERIMENTS', '')!r} (trainerd's and the clients': "
          "common/grpc_core_settings.py)")
    header = (f"{'agents':>7} {'max/s':>6} {'opening':>7} {'interval':>8} {'connect':>8} {'offered/s':>10} "
              f"{'handled/s':>10} {'ratio':>6} {'lag p50':>8} {'lag p99':>8} {'trainerd cpu':>12} {'clients cpu':>11} "
              f"{'false LOST':>10} {'broken':>7} {'deferred':>8}")
    print(header)
    asyncio.run(run_all(args))


async def run_all(args) -> None:
    """One event loop for every row: gRPC's poller must not outlive the loop it was started on."""
    with tempfile.TemporaryDirectory(prefix="trainerd-bench-") as tmp:
        if args.keep_logs is not None:
            args.keep_logs.mkdir(parents=True, exist_ok=True)
            tmp = str(args.keep_logs.resolve())
        rows = ((c, m, o) for c in args.agents for m in args.max_per_s for o in args.max_opening)
        for row, (count, max_per_s, max_opening) in enumerate(rows, 1):
            # Each row its own etcd and files: a row must not start from the nodes a previous one recorded.
            row_dir = Path(tmp) / f"row{row}"
            shutil.rmtree(row_dir, ignore_errors=True)
            row_dir.mkdir()
            r = await measure(count, max_per_s, max_opening, args, row_dir)
            print(f"{r['agents']:>7} {'off' if max_per_s >= 1e9 else f'{max_per_s:.0f}':>6} "
                  f"{'off' if max_opening >= 1_000_000 else max_opening:>7} {r['interval_s']:>7.2f}s "
                  f"{r['connect_s']:>7.1f}s {r['offered_per_s']:>10.0f} "
                  f"{r['handled_per_s']:>10.0f} {r['handled_per_s'] / r['offered_per_s']:>6.3f} "
                  f"{r['lag_p50_s'] * 1000:>6.1f}ms {r['lag_p99_s'] * 1000:>6.1f}ms "
                  f"{r['cpu_cores'] * 100:>11.0f}% {r['client_cpu_cores'] * 100:>10.0f}% {r['false_lost']:>10} "
                  f"{r['broken']:>7} {r['deferred']:>8}", flush=True)
            if r["welcomed"] < r["agents"]:
                print(f"        only {r['welcomed']} of {r['agents']} agents were welcomed", flush=True)
            if r["lost_leadership"]:
                print("        the coordinator lost its leadership", flush=True)
            if r["stall_s"]:
                print(f"        the coordinator's event loop ran {r['stall_s']:.1f}s late in all (excused)", flush=True)
            print(f"        the leader's periodic passes took up to {r['pass_max_s']:.2f}s ({r['passes_slow']} longer "
                  f"than 1s, whole run)", flush=True)
            print(f"        the agents wrote {r['sent_per_s']:.0f} heartbeats/s in the window (offered/s assumes every "
                  "agent at the coordinator's pace)", flush=True)
            print(f"        {r['acks']} acks read, {r['acks_late']} of them more than {LATE_ACK_S:.0f}s after their "
                  f"heartbeat was written, the longest {r['ack_round_trip_max_s']:.2f}s; the coordinator handled "
                  f"heartbeats within {r['run_lag_max_s']:.2f}s of their sending (p99 {r['run_lag_p99_s']:.2f}s), "
                  "over the whole run", flush=True)
            print(f"        the coordinator's ack writes took up to {r['ack_write_max_s']:.2f}s "
                  f"({r['ack_writes_slow']} longer than 2s, whole run; {r['ack_writes_waiting']:.0f} under way at the "
                  "window's end)", flush=True)
            print(f"        the agents' stream writes took up to {r['write_max_s']:.2f}s "
                  f"({r['writes_slow']} longer than {LATE_ACK_S:.0f}s)", flush=True)
            print(f"        the clients' event loops ran up to {r['loop_lag_max_s']:.1f}s late, "
                  f"{r['loop_late_s']:.1f}s in all late by more than {LATE_LOOP_S:.0f}s "
                  "(a late client loop reads acks late too)", flush=True)
            if r["broken"]:
                print(f"        {r['broken_in_window']} of the {r['broken']} broken sessions broke in the window, "
                      f"{r['broken'] - r['broken_in_window']} while agents connected or settled", flush=True)
            for reason, n in r["reasons"].most_common(8):
                print(f"        {n} session(s) broke after their Welcome: {reason}", flush=True)
            if r["end_heard"] and r["end_heard"][-1][1]:
                # Heard from shortly before: its heartbeats arrived and were acked, the acks never reached it.
                cumulative = r["end_heard"]
                labels = [f"≤{bound:g}s" for bound, _ in cumulative[:-1]] + [f">{cumulative[-2][0]:g}s"]
                spread = ", ".join(f"{label} {count - (cumulative[i - 1][1] if i else 0):.0f}"
                                   for i, (label, (_, count)) in enumerate(zip(labels, cumulative)))
                print(f"        {cumulative[-1][1]:.0f} session(s) ended (whole run), by how long before its end the "
                      f"coordinator had last heard from the agent: {spread}", flush=True)
            if r["broken"] > sum(r["reasons"].values()):
                print(f"        {r['broken'] - sum(r['reasons'].values())} session(s) broke after their Welcome: the "
                      "coordinator ended the stream without an error", flush=True)
            for line in r.get("connections", []):
                print(f"        connections: {line}", flush=True)
            for reason, n in r["refused"].most_common(8):
                print(f"        {n} attempt(s) failed before a Welcome: {reason}", flush=True)
            if len(r["refused"]) > 8:
                print(f"        and {sum(r['refused'].values()) - sum(n for _, n in r['refused'].most_common(8))} "
                      f"attempt(s) failing for {len(r['refused']) - 8} other reasons", flush=True)
            if "failover" in r:
                f = r["failover"]
                back = (f"all {r['agents']} agents were connected to it after {f['all_back_s']:.1f}s"
                        if f["all_back_s"] != float("inf") else "not every agent was back within 120 s")
                print(f"        failover: leader killed; the standby led after {f['leads_s']:.1f}s, {back} "
                      f"({f['connected']} now); false LOST {f['false_lost']}", flush=True)
            if args.baseline:
                b = await etcd_lease_baseline(r["agents"], args.seconds, row_dir)
                print(f"{'  baseline, etcd leases at 1 Hz (round trip, etcd cpu, leases lost):':<44} "
                      f"{b['per_s']:>10.0f} {b['per_s'] / r['agents']:>6.3f} {b['p50'] * 1000:>6.1f}ms "
                      f"{b['p99'] * 1000:>6.1f}ms {b['cpu'] * 100:>11.0f}% {'':>11} {b['lost']:>10}", flush=True)


if __name__ == "__main__":
    main()
