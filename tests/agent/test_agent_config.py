"""The agent's file and flags: flags win, mistakes name the file or flag and the key."""

import os
import socket
from pathlib import Path

import psutil
import pytest

from agent.config import load_agent_config
from agent.main import snapshot_peers_refusal
from agent.worker_user import WorkerUser
from common.config_file import ConfigError
from common.tls_files import TlsFiles

REPO = Path(__file__).resolve().parents[2]


def test_example_file_loads_and_flags_override_it() -> None:
    config = load_agent_config(str(REPO / "configs" / "agent.example.yaml"),
                               {"node_name": "override", "cpu_devices": 2, "coordinator": "h:1,h2:2"})
    assert config.node_name == "override"
    assert config.cpu_devices == 2
    assert config.coordinator == ["h:1", "h2:2"]
    assert config.work_dir == "/var/lib/trainerd-agent"
    assert config.allowed_entrypoints == [["{python}"]]


def test_warm_workers_are_on_and_the_compile_cache_off_unless_asked_for() -> None:
    """The compile cache breaks a functional training step (test_compile_cache_hazard.py): a user turns it on
    knowing their jobs step a Cell."""
    example = load_agent_config(str(REPO / "configs" / "agent.example.yaml"), {})
    assert example.warm_workers is True and example.compile_cache is False
    default = load_agent_config(None, {"coordinator": "127.0.0.1:1"})
    assert default.warm_workers is True and default.compile_cache is False
    flipped = load_agent_config(None, {"coordinator": "127.0.0.1:1", "warm_workers": False, "compile_cache": True})
    assert flipped.warm_workers is False and flipped.compile_cache is True


def test_snapshot_peers_serve_beyond_loopback_only_over_tls() -> None:
    config = load_agent_config(str(REPO / "configs" / "agent.example.yaml"), {})
    assert config.snapshot_peers is True and config.host == "10.0.0.21"
    assert "without TLS nothing listens beyond loopback, and this host is 10.0.0.21" in \
        snapshot_peers_refusal(config, None)
    tls = TlsFiles(b"ca", b"cert", b"key")
    assert snapshot_peers_refusal(config, tls) == ""
    loopback = load_agent_config(None, {"coordinator": "h:1", "host": "127.0.0.1"})
    assert snapshot_peers_refusal(loopback, None) == ""
    off = load_agent_config(None, {"coordinator": "127.0.0.1:1", "snapshot_peers": False})
    assert snapshot_peers_refusal(off, tls) == "snapshot_peers is off"


def test_the_host_is_by_default_this_hosts_address_toward_the_coordinator() -> None:
    """Not 127.0.0.1 whatever the coordinator: a host registered so joins jobs spanning hosts whose other
    ranks cannot reach it (a stranger's job waited in MindSpore's cluster set-up for it)."""
    assert load_agent_config(None, {"coordinator": "127.0.0.1:7420"}).host == "127.0.0.1"
    own = [a.address for addresses in psutil.net_if_addrs().values() for a in addresses
           if a.family == socket.AF_INET and not a.address.startswith("127.")]
    assert own, "this test needs a host with an IPv4 address beside loopback"
    assert load_agent_config(None, {"coordinator": f"{own[0]}:7420"}).host == own[0]
    assert load_agent_config(None, {"coordinator": f"{own[0]}:7420", "host": "10.1.2.3"}).host == "10.1.2.3"
    with pytest.raises(ConfigError, match="^agent flags: host: not given, and this host's address toward the "
                                          "coordinator no-such-host.invalid:7420 cannot be found"):
        load_agent_config(None, {"coordinator": "no-such-host.invalid:7420"})


def test_by_default_only_the_agents_own_interpreter_may_be_run() -> None:
    assert load_agent_config(None, {"coordinator": "127.0.0.1:1"}).allowed_entrypoints == [["{python}"]]


@pytest.mark.parametrize(("overrides", "message"), [
    ({}, "agent flags: coordinator: required"),
    ({"coordinator": "nohost"}, "agent flags: coordinator.0: 'nohost' is not HOST:PORT"),
    ({"coordinator": "127.0.0.1:1", "node_name": "bad name"}, "agent flags: node_name: String should match pattern"),
    ({"coordinator": "127.0.0.1:1", "cpu_devices": -1}, "agent flags: cpu_devices: Input should be greater than or equal to 0"),
])
def test_flag_mistakes(overrides, message) -> None:
    with pytest.raises(ConfigError) as info:
        load_agent_config(None, overrides)
    assert message in str(info.value)


def test_an_empty_entrypoint_prefix_is_refused_as_it_would_allow_everything(tmp_path: Path) -> None:
    path = tmp_path / "agent.yaml"
    path.write_text("coordinator: [127.0.0.1:1]\nallowed_entrypoints: [[]]\n")
    with pytest.raises(ConfigError, match=f"{path}: allowed_entrypoints.0: List should have at least 1 item"):
        load_agent_config(str(path), {})


def test_a_prefix_written_as_a_flat_list_is_refused_with_the_lists_to_write(tmp_path: Path) -> None:
    path = tmp_path / "agent.yaml"
    path.write_text("coordinator: [127.0.0.1:1]\nallowed_entrypoints: ['{python}', /srv/train.py]\n")
    with pytest.raises(ConfigError) as info:
        load_agent_config(str(path), {})
    assert str(info.value) == (f'{path}: allowed_entrypoints: is a list of prefixes, each a list of words: write '
                               f'[["{{python}}", "/srv/train.py"]] for one prefix, or [["{{python}}"], '
                               f'["/srv/train.py"]] for each word alone')


def test_unknown_key_in_file(tmp_path: Path) -> None:
    path = tmp_path / "agent.yaml"
    path.write_text("coordinator: [127.0.0.1:1]\ncoordinatr: x\n")
    with pytest.raises(ConfigError, match=f"{path}: coordinatr: unknown key \\(did you mean coordinator\\?\\)"):
        load_agent_config(str(path), {})
    path.write_text("coordinator: [127.0.0.1:1]\nzzz: x\n")  # nothing close: no guess
    with pytest.raises(ConfigError, match=f"{path}: zzz: unknown key$"):
        load_agent_config(str(path), {})


def test_run_as_names_a_user_and_group_of_this_host(tmp_path: Path, worker_user: WorkerUser) -> None:
    path = tmp_path / "agent.yaml"
    path.write_text(f"coordinator: [127.0.0.1:1]\nrun_as: {{user: {worker_user.name}, group: {worker_user.name}}}\n")
    run_as = load_agent_config(str(path), {}).run_as
    assert run_as is not None and WorkerUser.from_settings(run_as) == worker_user
    for text, message in [("{user: no-such-user-here}", "run_as: no user 'no-such-user-here' on this host"),
                          (f"{{user: {worker_user.name}, group: no-such-group}}", "run_as: no group 'no-such-group'")]:
        path.write_text(f"coordinator: [127.0.0.1:1]\nrun_as: {text}\n")
        with pytest.raises(ConfigError, match=f"{path}: {message}"):
            load_agent_config(str(path), {})


def test_run_as_needs_a_root_agent(tmp_path: Path, worker_user: WorkerUser, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "agent.yaml"
    path.write_text(f"coordinator: [127.0.0.1:1]\nrun_as: {{user: {worker_user.name}}}\n")
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(ConfigError, match=f"{path}: run_as: running the training processes as {worker_user.name} "
                                          "needs the agent to run as root"):
        load_agent_config(str(path), {})


def test_the_example_file_names_the_three_tls_files() -> None:
    config = load_agent_config(str(REPO / "configs" / "agent.example.yaml"), {})
    assert config.tls is not None and config.tls.cert_file == "/etc/trainerd/pki/node-01.crt"
    with pytest.raises(ConfigError, match="agent flags: tls.key_file: Field required"):
        load_agent_config(None, {"coordinator": "127.0.0.1:1", "tls": {"ca_file": "ca.crt", "cert_file": "n.crt"}})
