"""Joining a host with a token, with real processes over real TLS: trainerd (embedded etcd) serving cluster.join,
an operator making tokens with trainerctl, agents that start with nothing but the printed command line. The
joined agent keeps its key (0600) and certificate and starts from them later; a spent, deleted or mispinned
join is refused in one line; a revoked node's session is closed and its next dial refused."""

from __future__ import annotations

import re
import signal
import stat
from pathlib import Path

from tests.harness import Processes
from tests.integration.cluster_files import cluster_file
from tests.integration.test_tls_cluster import coordinator_tls, make_pki, node_states, one_line_failure, trainerctl
from tests.ports import free_port
from tests.waiting import wait_until


def join_security(pki: Path, join_listen: str, certificate_days: float = 30) -> dict:
    return {**coordinator_tls(pki), "join": {"listen": join_listen, "ca_key_file": str(pki / "ca.key"),
                                             "certificate_days": certificate_days}}


def create_token(address: str, pki: Path, *options: str) -> list[str]:
    """The trainerd-agent flags `trainerctl tokens create` prints, without --node-name."""
    result = trainerctl(address, "tokens", "create", *options, pki=pki, stem="alice")
    assert result.returncode == 0, result.stderr
    command = result.stdout.splitlines()[-1].split()
    assert command[0] == "trainerd-agent" and command[-2:] == ["--node-name", "NAME"], result.stdout
    return command[1:-2]


def without_coordinator(flags: list[str]) -> tuple[str, ...]:
    """The join flags; the harness passes --coordinator itself."""
    index = flags.index("--coordinator")
    return tuple(flags[:index] + flags[index + 2:])


def test_a_host_joins_with_a_token_alone_and_a_revoked_node_is_refused(tmp_path: Path, procs: Processes) -> None:
    pki = make_pki(tmp_path)
    address = f"127.0.0.1:{free_port()}"
    join_address = f"127.0.0.1:{free_port()}"
    # Certificates of 0.05 days, from an hour before they are made: due for renewal at once, at every session.
    procs.trainerd("trainerd", cluster_file(tmp_path, "c", listen=address,
                                            security=join_security(pki, join_address, certificate_days=0.05)))
    wait_until(lambda: trainerctl(address, "tokens", "list", pki=pki, stem="bob").returncode == 0, 30,
               "trainerd answers", on_timeout=procs.logs)

    flags = create_token(address, pki, "--uses", "1", "--ttl", "10m")
    assert flags[flags.index("--coordinator") + 1] == address
    assert flags[flags.index("--join-address") + 1] == join_address
    token = flags[flags.index("--join") + 1]
    listed = trainerctl(address, "tokens", "list", "-o", "json", pki=pki, stem="bob").stdout
    assert token.split(".")[1] not in listed and '"uses_left": 1' in listed

    # No TLS file of n1's: the token and the pin are all it has.
    n1 = procs.agent("n1", address, flags=without_coordinator(flags))
    wait_until(lambda: node_states(address, pki) == {"n1": "READY"}, 60, "n1 joined", on_timeout=procs.logs)
    stored = procs.root / "agents" / "n1" / "tls"
    assert stat.S_IMODE((stored / "node.key").stat().st_mode) == 0o600
    assert (stored / "ca.crt").read_bytes() == (pki / "ca.crt").read_bytes()
    assert "joined as node n1" in n1.log()
    wait_until(lambda: "renewed this node's certificate" in n1.log(), 30, "n1 renewed over its session",
               on_timeout=procs.logs)
    # The join listener serves nothing else, whatever certificate calls.
    one_line_failure(trainerctl(join_address, "status", pki=pki, stem="alice"), 3, "UNIMPLEMENTED")

    # The token is spent; a deleted token and a wrong pin are refused too, each in one line, exit 2.
    spent = procs.agent("n2", address, flags=without_coordinator(flags))
    assert spent.wait(timeout=60) == 2
    assert re.search(r"refused to join node n2: join token \w+ is spent", spent.log()), spent.log()
    other = create_token(address, pki)
    other_id = other[other.index("--join") + 1].split(".")[0]
    wrong_pin = [*other[:other.index("--ca-hash") + 1], "sha256:" + "0" * 64]
    mispinned = procs.agent("n3", address, flags=without_coordinator(wrong_pin))
    assert mispinned.wait(timeout=60) == 2
    assert "is not a coordinator of the pinned cluster" in mispinned.log(), mispinned.log()
    assert not (procs.root / "agents" / "n3" / "tls" / "node.key").exists()  # nothing made before it trusts
    assert trainerctl(address, "tokens", "delete", other_id, pki=pki, stem="alice").returncode == 0
    deleted = procs.agent("n4", address, flags=without_coordinator(other))
    assert deleted.wait(timeout=60) == 2
    assert f"join token {other_id} is unknown or was deleted" in deleted.log(), deleted.log()
    for refused in (spent, mispinned, deleted):
        assert len([line for line in refused.log().splitlines() if line.strip()]) == 1, refused.log()

    # A later start needs no token: the kept files serve.
    n1.signal(signal.SIGTERM)
    assert n1.wait(timeout=30) == 0
    n1 = procs.agent("n1", address)
    wait_until(lambda: "registered as n1" in n1.log(), 60, "n1 back from its kept files", on_timeout=procs.logs)
    assert n1.log().count("joined as node n1") == 1  # the log goes on from the first start's

    one_line_failure(trainerctl(address, "nodes", "revoke", "n1", pki=pki, stem="bob"), 1, "read-only")
    result = trainerctl(address, "nodes", "revoke", "n1", pki=pki, stem="alice")
    assert result.returncode == 0 and re.search(r"revoked [2-9] certificate\(s\) of node n1", result.stdout), \
        (result.stdout, result.stderr)  # the one it joined with and its renewals
    wait_until(lambda: "the certificate of node n1" in n1.log() and "is revoked" in n1.log(), 30,
               "n1's next dial refused", on_timeout=procs.logs)
    wait_until(lambda: node_states(address, pki) == {"n1": "LOST"}, 30, "n1 LOST", on_timeout=procs.logs)
