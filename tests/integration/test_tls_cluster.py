"""Secure by default, with real processes: trainerd (embedded etcd) serving mutual TLS with certificates
from `trainerd certs`, real agents with node certificates, trainerctl with operator certificates; the
clients that must be refused are, each in one line; and plain text off loopback only when written in."""

from __future__ import annotations

import ipaddress
import json
import signal
import socket
import subprocess
from pathlib import Path

import psutil
import yaml

from common.tls_files import TlsSettings
from tests.harness import BIN, Processes, status
from tests.integration.cluster_files import cluster_file
from tests.integration.test_job_launch import mlp_job
from tests.ports import free_port
from tests.waiting import wait_until

STEPS = 20


def certs(*argv: str) -> None:
    result = subprocess.run([str(BIN / "trainerd"), "certs", *argv], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


def make_pki(root: Path) -> Path:
    """The cluster's CA and coordinator, nodes n1 and n2, operators alice (full) and bob (read-only)."""
    pki = root / "pki"
    certs("init", "--dir", str(pki), "--host", "127.0.0.1")
    for name in ("n1", "n2"):
        certs("node", name, "--dir", str(pki))
    certs("operator", "alice", "--dir", str(pki))
    certs("operator", "bob", "--read-only", "--dir", str(pki))
    return pki


def tls_env(pki: Path, stem: str) -> dict[str, str]:
    """What an agent's or operator's host sets: the cluster's CA and its own certificate and key."""
    return {"TRAINERD_CACERT": str(pki / "ca.crt"), "TRAINERD_CERT": str(pki / f"{stem}.crt"),
            "TRAINERD_KEY": str(pki / f"{stem}.key")}


def coordinator_tls(pki: Path) -> dict:
    return {"tls": {"ca_file": str(pki / "ca.crt"), "cert_file": str(pki / "coordinator.crt"),
                    "key_file": str(pki / "coordinator.key")}}


def trainerctl(address: str, *argv: str, pki: Path | None = None, stem: str = "",
               ca_dir: Path | None = None) -> subprocess.CompletedProcess:
    """trainerctl with the certificate `stem` of `pki` (and the CA of `ca_dir`, default `pki`), or none."""
    options = []
    if pki is not None:
        options = ["--cacert", str((ca_dir or pki) / "ca.crt"), "--cert", str(pki / f"{stem}.crt"),
                   "--key", str(pki / f"{stem}.key")]
    return subprocess.run([str(BIN / "trainerctl"), "--coordinator", address, *options, *argv],
                          capture_output=True, text=True, timeout=60)


def status_as(address: str, pki: Path, stem: str) -> dict | None:
    """`trainerctl status -o json` with the certificate `stem` of `pki` (in-process: tests.harness.status)."""
    return status(address, TlsSettings(ca_file=str(pki / "ca.crt"), cert_file=str(pki / f"{stem}.crt"),
                                       key_file=str(pki / f"{stem}.key")))


def node_states(address: str, pki: Path) -> dict[str, str]:
    data = status_as(address, pki, "bob")
    return {} if data is None else {node["name"]: node["state"] for node in data["nodes"]}


def one_line_failure(result: subprocess.CompletedProcess, code: int, *fragments: str) -> None:
    assert result.returncode == code, (result.returncode, result.stderr)
    assert len(result.stderr.splitlines()) == 1, result.stderr
    for fragment in fragments:
        assert fragment in result.stderr, result.stderr


def test_mindspore_job_runs_over_mutual_tls(tmp_path: Path, procs: Processes) -> None:
    pki = make_pki(tmp_path)
    address = f"127.0.0.1:{free_port()}"
    procs.trainerd("trainerd", cluster_file(tmp_path, "c", listen=address, job=mlp_job(tmp_path, steps=STEPS),
                                            security=coordinator_tls(pki)))
    for name in ("n1", "n2"):
        procs.agent(name, address, env=tls_env(pki, name))

    def ended_job() -> dict | None:
        job = (status_as(address, pki, "bob") or {}).get("job")
        return job if job and job["state"] in ("COMPLETED", "FAILED") else None

    job = wait_until(ended_job, 180, "the job ends", interval=0.5, on_timeout=procs.logs)
    assert job["state"] == "COMPLETED", job
    assert (job["generation"], job["world_size"], job["step"]) == (1, 2, STEPS)
    assert {rank["node"] for rank in job["ranks"]} == {"n1", "n2"}
    # The agents relay a rank's output to a read-only operator over the same TLS sessions.
    result = trainerctl(address, "logs", "0", "--tail", "5", pki=pki, stem="bob")
    assert result.returncode == 0 and result.stdout, result.stderr
    assert "TLS, client certificates of its CA only" in procs.by_name("trainerd").log()


def test_clients_without_the_right_certificate_are_refused_in_one_line(tmp_path: Path, procs: Processes) -> None:
    pki = make_pki(tmp_path)
    other = tmp_path / "other"
    certs("init", "--dir", str(other / "pki"))
    certs("operator", "alice", "--dir", str(other / "pki"))
    address = f"127.0.0.1:{free_port()}"
    procs.trainerd("trainerd", cluster_file(tmp_path, "c", listen=address, security=coordinator_tls(pki)))
    procs.agent("n1", address, env=tls_env(pki, "n1"))
    wait_until(lambda: node_states(address, pki) == {"n1": "READY"}, 30, "n1 READY", on_timeout=procs.logs)

    # An agent given n1's certificate as n2 says so at start-up, in one line, and never joins (the coordinator
    # refuses such a session all the same, whoever dials: tests/daemon/test_tls.py).
    impostor = procs.agent("n2", address, env=tls_env(pki, "n1"))
    assert impostor.wait(timeout=30) == 2
    assert "is node n1's certificate, but this agent is node n2" in impostor.log()
    assert node_states(address, pki) == {"n1": "READY"}

    one_line_failure(trainerctl(address, "status"), 3, "cannot reach the coordinator",
                     "if the coordinator serves TLS, pass --cacert, --cert and --key")
    # A certificate of another CA beside this cluster's CA file: refused before it is ever sent.
    one_line_failure(trainerctl(address, "status", pki=other / "pki", stem="alice", ca_dir=pki), 2,
                     f"--cert: {other / 'pki' / 'alice.crt'} was not issued by the CA in {pki / 'ca.crt'}")
    one_line_failure(trainerctl(address, "status", pki=other / "pki", stem="alice"), 3,
                     "CERTIFICATE_VERIFY_FAILED", "the coordinator's certificate is not one the CA in --cacert signed")
    one_line_failure(trainerctl(address, "status", pki=pki, stem="n1"), 1,
                     "the certificate of node n1 cannot call GetStatus: it needs an operator certificate")
    one_line_failure(trainerctl(address, "pause", pki=pki, stem="bob"), 1,
                     "operator bob is read-only: Pause needs a full (not read-only) operator certificate")
    one_line_failure(trainerctl(address, "nodes", "drain", "n1", pki=pki, stem="bob"), 1, "read-only")

    result = trainerctl(address, "status", pki=pki, stem="bob")
    assert result.returncode == 0 and "n1" in result.stdout, result.stderr
    result = trainerctl(address, "nodes", "drain", "n1", pki=pki, stem="alice")
    assert result.returncode == 0, result.stderr
    assert status_as(address, pki, "bob")["nodes"][0]["drained"] is True


def test_trainerd_refuses_plain_text_off_loopback_unless_insecure_is_written(tmp_path: Path,
                                                                            procs: Processes) -> None:
    port = free_port()
    path = cluster_file(tmp_path, "exposed", listen=f"0.0.0.0:{port}")
    refused = subprocess.run([str(BIN / "trainerd"), "start", "--cluster", str(path)], capture_output=True,
                             text=True, timeout=60)
    one_line_failure(refused, 2, f"{path}: cluster: coordinator.listen 0.0.0.0:{port} is not a loopback address",
                     "write insecure: true")
    assert not (tmp_path / "exposed-etcd").exists()  # refused before anything started

    data = yaml.safe_load(path.read_text())
    data["cluster"]["insecure"] = True
    path.write_text(yaml.safe_dump(data))
    procs.trainerd("trainerd", path)
    wait_until(lambda: (result := trainerctl(f"127.0.0.1:{port}", "status", "-o", "json")).returncode == 0
               and json.loads(result.stdout)["coordinator"]["is_leader"], 30, "trainerd leads in plain text",
               on_timeout=procs.logs)


def test_a_coordinator_dialled_at_an_address_its_certificate_lacks_says_so_and_a_reissued_one_serves(
        tmp_path: Path, procs: Processes) -> None:
    """127.0.0.2 is loopback too, but not among the names `trainerd certs init` gave the coordinator: trainerctl and
    the agent say what to do in one line each; `trainerd certs coordinator` reissues the certificate from the same
    CA, and the node and operator certificates made before it still work."""
    pki = make_pki(tmp_path)
    address = f"127.0.0.2:{free_port()}"
    cluster = cluster_file(tmp_path, "c", listen=address, security=coordinator_tls(pki))
    trainerd = procs.trainerd("trainerd", cluster)
    agent = procs.agent("n1", address, env=tls_env(pki, "n1"))
    hint = "the coordinator's certificate does not name 127.0.0.2: dial it by a name its certificate carries"
    reissue = "`trainerd certs coordinator --dir DIR --host 127.0.0.2`"
    wait_until(lambda: hint in trainerctl(address, "status", pki=pki, stem="bob").stderr, 30,
               "trainerctl's hint", on_timeout=procs.logs)
    one_line_failure(trainerctl(address, "status", pki=pki, stem="bob"), 3, "Hostname Verification", hint, reissue)
    wait_until(lambda: hint in agent.log() and reissue in agent.log(), 30, "the agent's hint", on_timeout=procs.logs)

    certs("coordinator", "--dir", str(pki), "--host", "127.0.0.2", "--force")
    trainerd.signal(signal.SIGTERM)
    assert trainerd.wait(timeout=30) == 0
    procs.trainerd("trainerd-reissued", cluster)
    wait_until(lambda: node_states(address, pki) == {"n1": "READY"}, 60, "n1 READY with the old node certificate",
               on_timeout=procs.logs)


def this_hosts_address() -> str:
    """An IPv4 address of this host that is not loopback: where another host would dial it."""
    for addresses in psutil.net_if_addrs().values():
        for address in addresses:
            if address.family == socket.AF_INET and not ipaddress.ip_address(address.address).is_loopback:
                return address.address
    raise AssertionError("this host has no IPv4 address off loopback")


def test_a_standby_on_another_host_shares_the_embedded_etcd_over_tls_without_insecure(
        tmp_path: Path, procs: Processes) -> None:
    """The leader's embedded etcd listens on every address (no `insecure: true`), serving TLS with the coordinator's
    certificate; a standby dials it at this host's own address with the cluster's CA and coordinator certificate,
    stands by, and leads on that etcd when the leader freezes. The standby given an agent's certificate of the same
    CA is refused by etcd and exits 1."""
    host = this_hosts_address()
    pki = make_pki(tmp_path)
    certs("coordinator", "--dir", str(pki), "--host", "127.0.0.1", "--host", host, "--force")
    etcd_port = free_port()
    leader_address, standby_address = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    leader_file = cluster_file(tmp_path, "leader", listen=leader_address, security=coordinator_tls(pki))
    data = yaml.safe_load(leader_file.read_text())
    data["cluster"]["etcd"]["client_listen"] = f"0.0.0.0:{etcd_port}"
    leader_file.write_text(yaml.safe_dump(data))
    leader = procs.trainerd("leader", leader_file)
    procs.agent("n1", f"{leader_address},{standby_address}", env=tls_env(pki, "n1"))
    wait_until(lambda: node_states(leader_address, pki) == {"n1": "READY"}, 60, "n1 READY",
               on_timeout=procs.logs)

    def standby_file(name: str, stem: str) -> Path:
        path = cluster_file(tmp_path, name, listen=standby_address, etcd_endpoints=[f"{host}:{etcd_port}"],
                            security=coordinator_tls(pki))
        data = yaml.safe_load(path.read_text())
        data["cluster"]["etcd"] |= {"ca_file": str(pki / "ca.crt"), "cert_file": str(pki / f"{stem}.crt"),
                                    "key_file": str(pki / f"{stem}.key")}
        path.write_text(yaml.safe_dump(data))
        return path

    impostor = procs.trainerd("standby-as-n1", standby_file("impostor", "n1"))
    assert impostor.wait(timeout=60) == 1, procs.logs()
    assert impostor.log().strip().splitlines()[-1] == f"trainerd: no etcd endpoint answered within 5.0 s: {host}:{etcd_port}"

    standby = procs.trainerd("standby", standby_file("standby", "coordinator"))
    wait_until(lambda: "standing by: " in standby.log(), 60, "the standby stands by", on_timeout=procs.logs)
    # trainerctl asked at the standby follows it to the leader it names (read in etcd).
    assert status_as(standby_address, pki, "bob")["coordinator"]["leader"] == leader_address

    leader.signal(signal.SIGSTOP)  # its etcd, a process of its own, serves on; its lease is no longer kept
    try:
        wait_until(lambda: (status_as(standby_address, pki, "bob") or {}).get("coordinator", {}).get("is_leader"),
                   60, "the standby leads on the leader's etcd", on_timeout=procs.logs)
        wait_until(lambda: node_states(standby_address, pki) == {"n1": "READY"}, 60, "n1 READY with the standby",
                   on_timeout=procs.logs)
    finally:
        leader.signal(signal.SIGCONT)
