"""A trainerd killed by SIGKILL runs no clean-up: what it started must end by itself, not live on beside
the next trainerd (its etcd holding the ports, its local agents under the node names the next one's use)."""

from __future__ import annotations

import re
import signal
from pathlib import Path

import psutil

from tests.harness import processes_mentioning, start_trainerd_in
from tests.ports import free_port
from tests.waiting import wait_until


def test_the_embedded_etcd_and_the_local_agents_end_with_a_trainerd_killed_by_sigkill(tmp_path: Path) -> None:
    listen, client, peer = free_port(), free_port(), free_port()
    trainerd, log_path = start_trainerd_in(tmp_path, (
        f"cluster:\n  local_agents: 2\n  coordinator: {{listen: '127.0.0.1:{listen}'}}\n"
        f"  etcd: {{client_listen: '127.0.0.1:{client}', peer_listen: '127.0.0.1:{peer}'}}\n"))
    try:
        def children() -> list[int] | None:
            text = log_path.read_text(errors="replace")
            agents = [int(pid) for pid in re.findall(r"started local agent \S+ \(pid (\d+)\)", text)]
            etcd = re.findall(r"etcd \S+ \(pid (\d+)\) serves", text)
            return [int(etcd[0]), *agents] if etcd and len(agents) == 2 else None

        pids = wait_until(children, timeout=60, what="trainerd to start etcd and two local agents",
                          on_timeout=lambda: log_path.read_text(errors="replace")[-3000:])
        trainerd.send_signal(signal.SIGKILL)
        trainerd.wait(timeout=10)
        wait_until(lambda: not any(_running(pid) for pid in pids), timeout=30,
                   what=f"etcd and the local agents ({pids}) to end with trainerd")
    finally:
        trainerd.kill()
        trainerd.wait(timeout=10)
        for leftover in processes_mentioning(tmp_path):
            leftover.kill()


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
