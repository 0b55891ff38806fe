"""trainerd supervises its embedded etcd: a killed etcd is restarted and trainerd leads again; when
the restart fails, trainerd exits non-zero with one line, so that systemd restarts it. Real trainerd,
agent, etcd and trainerctl processes; no MindSpore."""

from __future__ import annotations

import os
import signal
import socket
from pathlib import Path

import psutil
import yaml

from tests.harness import Processes, status
from tests.integration.cluster_files import cluster_file
from tests.ports import free_port
from tests.waiting import wait_until


def etcd_of(trainerd_pid: int) -> psutil.Process | None:
    """The embedded etcd trainerd runs (a child process of its own), once it runs."""
    for child in psutil.Process(trainerd_pid).children():
        try:
            if child.name() == "etcd" and child.status() != psutil.STATUS_ZOMBIE:
                return child
        except psutil.NoSuchProcess:
            continue
    return None


def bound(sock: socket.socket, port: int) -> bool:
    try:
        sock.bind(("127.0.0.1", port))
    except OSError:
        return False
    return True


def leads_with(address: str, nodes: dict[str, str]) -> bool:
    data = status(address)
    return bool(data and data["coordinator"]["is_leader"]
                and {n["name"]: n["state"] for n in data["nodes"]} == nodes)


def test_a_killed_embedded_etcd_is_restarted_and_trainerd_leads_again(tmp_path: Path, procs: Processes) -> None:
    address = f"127.0.0.1:{free_port()}"
    trainerd = procs.trainerd("trainerd", cluster_file(tmp_path, "c", listen=address))
    procs.agent("node-a", address)
    wait_until(lambda: leads_with(address, {"node-a": "READY"}), 30, "trainerd leads with node-a READY",
               on_timeout=procs.logs)

    for _ in range(2):
        etcd = etcd_of(trainerd.pid)
        assert etcd is not None
        etcd.send_signal(signal.SIGKILL)
        wait_until(lambda killed=etcd.pid: getattr(etcd_of(trainerd.pid), "pid", killed) != killed, 15,
                   "a new etcd process", interval=0.1, on_timeout=procs.logs)
        wait_until(lambda: leads_with(address, {"node-a": "READY"}), 30, "trainerd leads again with node-a READY",
                   on_timeout=procs.logs)
        assert trainerd.alive()
    log = trainerd.log()
    assert log.count("was killed by signal 9; restarting it with the same data") == 2


def test_trainerd_exits_non_zero_with_one_line_when_its_etcd_cannot_be_restarted(
        tmp_path: Path, procs: Processes) -> None:
    address = f"127.0.0.1:{free_port()}"
    path = cluster_file(tmp_path, "c", listen=address)
    client_port = int(yaml.safe_load(path.read_text())["cluster"]["etcd"]["client_listen"].rsplit(":", 1)[1])
    trainerd = procs.trainerd("trainerd", path)
    wait_until(lambda: leads_with(address, {}), 30, "trainerd leads", on_timeout=procs.logs)
    etcd = etcd_of(trainerd.pid)
    assert etcd is not None

    os.kill(trainerd.pid, signal.SIGSTOP)  # so that the port is taken before trainerd can restart etcd
    etcd.send_signal(signal.SIGKILL)
    wait_until(lambda: etcd.status() == psutil.STATUS_ZOMBIE, 10, "etcd dead (its stopped parent reaps it later)")
    with socket.socket() as taken:
        taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        wait_until(lambda: bound(taken, client_port), 10, "etcd's port free (its threads may still be exiting)")
        taken.listen()
        os.kill(trainerd.pid, signal.SIGCONT)
        code = trainerd.wait(timeout=30)
    assert code == 1, procs.logs()
    last = trainerd.log().strip().splitlines()[-1]
    assert last == (f"trainerd: cannot start the embedded etcd: 127.0.0.1:{client_port} (etcd.client_listen) is in use: "
                    f"another program listens there: stop it, or give etcd.client_listen another port")
    assert status(address) is None  # the coordinator is gone with it


def test_a_job_completes_when_its_embedded_etcd_is_killed_mid_run(tmp_path: Path, procs: Processes) -> None:
    """The MLP example on two local agents; SIGKILL the embedded etcd while it trains: trainerd
    restarts it and the job completes (the generation is not torn down: liveness lives in memory)."""
    from tests.integration.test_job_launch import mlp_job, start_cluster, wait_for_state

    steps = 600  # the steps at least 12 ms apart: a few seconds of training after etcd's restart on an idle machine
    address = start_cluster(tmp_path, procs, mlp_job(tmp_path, steps=steps, min_step_ms=12))
    wait_for_state(address, {"RUNNING"}, 180, procs)
    trainerd = procs.by_name("trainerd")
    etcd = etcd_of(trainerd.pid)
    assert etcd is not None
    etcd.send_signal(signal.SIGKILL)
    job = wait_for_state(address, {"COMPLETED", "FAILED"}, 240, procs)
    assert job["state"] == "COMPLETED" and job["step"] == steps, job
    assert trainerd.alive()
    assert "was killed by signal 9; restarting it with the same data" in trainerd.log()
