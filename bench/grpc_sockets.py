"""Where a silent stream's messages are, for `bench/heartbeats.py --queues-every S [--channelz]`.

`--queues-every`: every S seconds the bench takes the kernel's receive and send queues of every
connection to trainerd (`ss`: both ends are on this machine), which costs the processes measured
nothing. Bytes that stay in a receive queue record after record are bytes that side's gRPC core did
not read from its socket (`unread_queues`).

`--channelz` adds gRPC's own record of each connection (channelz), taken in trainerd (run through
bench/channelz_trainerd.py) and in every client process at each SIGUSR2 the bench sends, written to
`{directory}/{side}-{pid}-{round}.json` (`silent_streams`). It holds each process's GIL for seconds at
10,000 connections, so it disturbs what it measures. Measured on grpcio 1.85 (by hand, a bidi
stream whose server handler had not read yet): a client socket's `messagesSent` counts a message once
its write completed, before the server has it; a server socket's `messagesReceived` counts it only
once the handler's read took it.
"""

from __future__ import annotations

import datetime
import itertools
import json
import math
import os
import signal
import subprocess
import time
from collections import Counter
from pathlib import Path
from typing import Any

from grpc._cython import cygrpc

PAGE = 100


def _seconds(timestamp: str | None) -> float | None:
    """An RFC 3339 timestamp with nanoseconds, as channelz writes them, in seconds since the epoch."""
    if not timestamp:
        return None
    whole, _, fraction = timestamp.rstrip("Z").partition(".")
    moment = datetime.datetime.fromisoformat(whole).replace(tzinfo=datetime.timezone.utc)
    return moment.timestamp() + (float(f"0.{fraction}") if fraction else 0.0)


def _summary(socket: dict[str, Any]) -> dict[str, Any]:
    data = socket.get("data", {})

    def number(key: str) -> int:
        return int(data.get(key, 0))

    return {
        "local_port": socket.get("local", {}).get("tcpipAddress", {}).get("port"),
        "remote_port": socket.get("remote", {}).get("tcpipAddress", {}).get("port"),
        "streams_open": number("streamsStarted") - number("streamsSucceeded") - number("streamsFailed"),
        "sent": number("messagesSent"),
        "received": number("messagesReceived"),
        "last_sent": _seconds(data.get("lastMessageSentTimestamp")),
        "last_received": _seconds(data.get("lastMessageReceivedTimestamp")),
        "last_stream": _seconds(data.get("lastLocalStreamCreatedTimestamp")
                                or data.get("lastRemoteStreamCreatedTimestamp")),
        "keepalives_sent": number("keepAlivesSent"),
        "local_window": data.get("localFlowControlWindow"),
        "remote_window": data.get("remoteFlowControlWindow"),
    }


def _socket(socket_id: int) -> dict[str, Any] | None:
    try:
        return json.loads(cygrpc.channelz_get_socket(socket_id))["socket"]
    except (ValueError, KeyError):  # closed since it was listed
        return None


def client_sockets() -> list[dict[str, Any]]:
    """Every connection of this process's channels."""
    channels: list[dict[str, Any]] = []
    start = 0
    while True:
        page = json.loads(cygrpc.channelz_get_top_channels(start))
        channels += page.get("channel", [])
        if page.get("end", False) or not page.get("channel"):
            break
        start = int(channels[-1]["ref"]["channelId"]) + 1
    sockets = []
    for channel in channels:
        for ref in channel.get("subchannelRef", []):
            try:
                subchannel = json.loads(cygrpc.channelz_get_subchannel(int(ref["subchannelId"])))["subchannel"]
            except (ValueError, KeyError):
                continue
            for socket_ref in subchannel.get("socketRef", []):
                socket = _socket(int(socket_ref["socketId"]))
                if socket is not None:
                    sockets.append(_summary(socket))
    return sockets


def server_sockets() -> list[dict[str, Any]]:
    """Every connection this process's servers accepted."""
    sockets = []
    for server in json.loads(cygrpc.channelz_get_servers(0)).get("server", []):
        server_id, start = int(server["ref"]["serverId"]), 0
        while True:
            page = json.loads(cygrpc.channelz_get_server_sockets(server_id, start, PAGE))
            refs = page.get("socketRef", [])
            for ref in refs:
                socket = _socket(int(ref["socketId"]))
                if socket is not None:
                    sockets.append(_summary(socket))
            if page.get("end", False) or not refs:
                break
            start = int(refs[-1]["socketId"]) + 1
    return sockets


def dump_on_signal(directory: Path, side: str) -> None:
    """At every SIGUSR2, write this process's sockets (`side` "server" or "client") to `directory`."""
    rounds = itertools.count()

    def dump(_signum: int, _frame: object) -> None:
        taken = time.time()
        sockets = server_sockets() if side == "server" else client_sockets()
        path = directory / f"{side}-{os.getpid()}-{next(rounds)}.json"
        path.write_text(json.dumps({"taken": taken, "sockets": sockets}))

    signal.signal(signal.SIGUSR2, dump)


def save_kernel_queues(path: Path, port: int) -> None:
    """The established TCP connections to or from `port`, from `ss -i`, saved to `path` as [local port,
    peer port, bytes in the receive queue, bytes in the send queue, bytes received in all] rows."""
    shown = subprocess.run(["ss", "-tniH", "state", "established", f"( sport = :{port} or dport = :{port} )"],
                           capture_output=True, text=True, check=True).stdout
    rows: list[list[int]] = []
    for line in shown.splitlines():
        fields = line.split()
        if not line.startswith((" ", "\t")) and len(fields) >= 4:
            rows.append([int(fields[2].rsplit(":", 1)[1]), int(fields[3].rsplit(":", 1)[1]),
                         int(fields[0]), int(fields[1]), 0])
        elif rows:  # the socket's details, under its line
            received = next((f for f in fields if f.startswith("bytes_received:")), "bytes_received:0")
            rows[-1][4] = int(received.split(":")[1])
    path.write_text(json.dumps({"taken": time.time(), "port": port, "rows": rows}))


def _load(directory: Path, pattern: str) -> list[dict[str, Any]]:
    return [json.loads(path.read_text()) for path in sorted(directory.glob(pattern))]


def _kernel_records(directory: Path) -> list[Path]:
    return sorted(directory.glob("kernel-*.json"), key=lambda path: int(path.stem.split("-")[1]))


def unread_queues(directory: Path, every_s: float) -> list[str]:
    """Lines that say, for the agents' side and trainerd's, how many connections held bytes in their
    receive queue record after record (taken `every_s` apart): bytes that side's gRPC did not read from
    the socket for at least the time between the first and the last of those records. With heartbeats
    seconds apart, a side that reads its sockets shows an empty queue at almost every record."""
    held: dict[str, dict[int, int]] = {"agent": {}, "trainerd": {}}      # connection -> records in a row
    longest: dict[str, dict[int, int]] = {"agent": {}, "trainerd": {}}
    per_record: dict[str, list[int]] = {"agent": [], "trainerd": []}
    for path in _kernel_records(directory):
        record = json.loads(path.read_text())
        now: dict[str, set[int]] = {"agent": set(), "trainerd": set()}
        for local, peer, receive_queue, *_ in record["rows"]:
            side, connection = ("trainerd", peer) if local == record["port"] else ("agent", local)
            if receive_queue:
                now[side].add(connection)
        for side, connections in now.items():
            held[side] = {c: held[side].get(c, 0) + 1 for c in connections}
            for connection, run in held[side].items():
                longest[side][connection] = max(longest[side].get(connection, 0), run)
            per_record[side].append(len(connections))
    lines = []
    for side, runs in longest.items():
        if not per_record[side]:
            continue
        counts = sorted(per_record[side])
        stuck = {c: run for c, run in runs.items() if run >= 2}
        worst = max(stuck.values(), default=0)
        lines.append(
            f"{side} side: connections with unread bytes per record (every {every_s:g}s, {len(counts)} records): "
            f"median {counts[len(counts) // 2]}, most {counts[-1]}; {len(stuck)} connections held unread bytes in 2 "
            f"or more records in a row (unread {every_s:g}s+)"
            + (f", the longest {worst} records ({(worst - 1) * every_s:g}s+)" if stuck else ""))
    return lines


# Over two heartbeat intervals a live stream moves two messages each way (60-80 bytes each on the
# wire); keepalive pings and their acks add at most 68 bytes (17 each, every 10 s from each side).
QUIET_BYTES = 100


def wire_silence(directory: Path, every_s: float, span_s: float, window_start: float) -> list[str]:
    """Lines that say how many connections' receiving kernel got fewer than QUIET_BYTES from trainerd
    over `span_s` (records `every_s` apart; two heartbeat intervals or more: no ack reached the agent's
    host), split by whether the agent's heartbeats reached trainerd's kernel meanwhile; in the records
    from `window_start` (time.time(): every agent welcomed, so every connection carries a session; before
    it, an agent waiting for its Welcome hears nothing too). Bytes that reached a kernel and left no
    receive queue behind were read by that side's gRPC core; so with the heartbeats in, the acks were
    held in trainerd's process, and without them, in the agent's."""
    records = [record for record in (json.loads(path.read_text()) for path in _kernel_records(directory))
               if record["taken"] >= window_start]
    back = max(1, math.ceil(span_s / every_s))
    # connection (the agent's port) -> per record: (bytes the agent's kernel received, trainerd's kernel did)
    history: list[dict[int, tuple[int, int]]] = []
    for record in records:
        received: dict[int, list[int]] = {}
        for local, peer, _, _, total in record["rows"]:
            if local == record["port"]:
                received.setdefault(peer, [0, 0])[1] = total
            else:
                received.setdefault(local, [0, 0])[0] = total
        history.append({connection: (down, up) for connection, (down, up) in received.items()})
    quiet: dict[int, bool] = {}  # connection -> whether the heartbeats got through while the acks did not
    for k in range(back, len(history)):
        for connection, (down, up) in history[k].items():
            earlier = history[k - back].get(connection)
            if earlier is None or down - earlier[0] >= QUIET_BYTES:
                continue
            quiet[connection] = quiet.get(connection, False) or up - earlier[1] >= QUIET_BYTES
    heartbeats_in = sum(quiet.values())
    return [f"in the window ({len(records)} records): {len(quiet)} connections received fewer than {QUIET_BYTES} "
            f"bytes from trainerd over {back * every_s:g}s (no ack reached the agent's host): on {heartbeats_in} of "
            f"them the agent's heartbeats reached trainerd's kernel meanwhile, on {len(quiet) - heartbeats_in} they "
            "did not"]


def _ago(now: float, then: float | None) -> str:
    return f"{now - then:.1f}s" if then else "never"


def _latest(sockets: list[dict[str, Any]]) -> float:
    """The newest message time in a record: "now" on gRPC's clock, whose channelz timestamps run some
    seconds apart from time.time() (seen by hand: a message stamped before its channel was created).
    With thousands of agents heartbeating, some message moved within milliseconds of the record."""
    return max((t for sock in sockets for t in (sock["last_sent"], sock["last_received"]) if t), default=0.0)


def _where(sock: dict[str, Any], peer: dict[str, Any], client_queue: tuple[int, int],
           server_queue: tuple[int, int], client_now: float, server_now: float) -> tuple[str, str]:
    """One silent stream's kind (how many messages each way were written and not yet read, and which
    kernel queues held bytes) and its numbers, for `silent_streams`."""
    up = sock["sent"] - peer["received"]      # the agent's messages trainerd's handler has not read
    down = peer["sent"] - sock["received"]    # trainerd's the agent has not read
    where = []
    if client_queue[1] or server_queue[0]:
        where.append(f"up bytes in the kernel (agent send {client_queue[1]}, trainerd receive {server_queue[0]})")
    if server_queue[1] or client_queue[0]:
        where.append(f"down bytes in the kernel (trainerd send {server_queue[1]}, agent receive {client_queue[0]})")
    queues = "; ".join(where) or "kernel queues empty"
    kind = (f"agent->trainerd: {up} unread; trainerd->agent: {down} unread; {queues}" if up <= 1 and down <= 1
            else f"more than one unread: {queues}")
    detail = (f"agent sent {sock['sent']} (last {_ago(client_now, sock['last_sent'])} ago), trainerd "
              f"read {peer['received']} (last {_ago(server_now, peer['last_received'])} ago); trainerd "
              f"sent {peer['sent']} (last {_ago(server_now, peer['last_sent'])} ago), agent read "
              f"{sock['received']} (last {_ago(client_now, sock['last_received'])} ago); flow windows "
              f"at trainerd local {peer['local_window']} remote {peer['remote_window']}")
    return kind, detail


def silent_streams(directory: Path, every_s: float) -> list[str]:
    """Lines that say, for every record after the first, how many agents' streams delivered no message
    to the agent since the record before (`every_s` earlier) though the same stream stayed open, and
    where their messages were: written by one side and not yet read by the other (counted by gRPC at
    each end), and whether bytes were waiting in a kernel queue. Ages ("last ... ago") are on gRPC's
    clock (`_latest`)."""
    lines = []
    previous: dict[int, dict[str, Any]] = {}
    for kernel_path in _kernel_records(directory):
        number = kernel_path.stem.split("-")[1]
        servers = _load(directory, f"server-*-{number}.json")
        clients = _load(directory, f"client-*-{number}.json")
        if not servers or not clients:
            lines.append(f"record {number}: incomplete ({len(servers)} server, {len(clients)} client files)")
            previous = {}
            continue
        queues = {(row[0], row[1]): (row[2], row[3]) for row in json.loads(kernel_path.read_text())["rows"]}
        server_sockets_now = [sock for server in servers for sock in server["sockets"]]
        by_peer = {sock["remote_port"]: sock for sock in server_sockets_now}
        server_now = _latest(server_sockets_now)
        server_port = server_sockets_now[0]["local_port"] if server_sockets_now else None
        kinds: Counter[str] = Counter()
        examples: dict[str, str] = {}
        current: dict[int, dict[str, Any]] = {}
        open_streams = 0
        for client in clients:
            client_now = _latest(client["sockets"])
            for sock in client["sockets"]:
                port = sock["local_port"]
                current[port] = sock
                before = previous.get(port)
                if sock["streams_open"] < 1:
                    continue
                open_streams += 1
                if (before is None or before["streams_open"] < 1 or before["last_stream"] != sock["last_stream"]
                        or before["received"] != sock["received"]):
                    continue  # a new stream since, or a message delivered to the agent since
                peer = by_peer.get(port)
                kind, detail = ("trainerd has no such connection", "") if peer is None else _where(
                    sock, peer, queues.get((port, server_port), (0, 0)), queues.get((server_port, port), (0, 0)),
                    client_now, server_now)
                kinds[kind] += 1
                examples.setdefault(kind, detail)
        if previous:
            lines.append(f"record {number}: {sum(kinds.values())} of {open_streams} open streams delivered nothing "
                         f"to their agent in the {every_s:.0f}s since the record before")
            for kind, count in kinds.most_common(6):
                lines.append(f"  {count}: {kind}" + (f" (e.g. {examples[kind]})" if examples[kind] else ""))
        previous = current
    return lines
