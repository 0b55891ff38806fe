"""A user's mistake gets one line on stderr and a non-zero exit, never a traceback."""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path

import pytest

from daemon.cli.trainerctl import global_options_first
from tests.harness import BIN
from tests.ports import free_port


def run(*argv: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / argv[0]), *argv[1:]], capture_output=True, text=True, timeout=60, env=env)


def assert_one_line_error(result: subprocess.CompletedProcess, code: int, *fragments: str) -> None:
    assert result.returncode == code, (result.returncode, result.stderr)
    assert "Traceback" not in result.stderr
    error_lines = [line for line in result.stderr.splitlines() if line.startswith("Error:") or ": " in line]
    assert error_lines, result.stderr
    for fragment in fragments:
        assert fragment in result.stderr, result.stderr


@pytest.mark.parametrize(("text", "fragment"), [
    ("cluster:\n  heartbeat: {interval_s: fast}\n", "cluster.heartbeat.interval_s"),
    ("cluster:\n  nope: 1\n", "cluster.nope: unknown key"),
    ("cluster: [\n", "malformed YAML"),
    ("cluster:\n  coordinator: {listen: 'x'}\n", "cluster.coordinator.listen"),
    ("job:\n  entrypoint: [a]\n  global_batch: 10\n  micro_batch: 4\n", "job: global_batch 10 cannot be kept"),
    # Local agents would refuse every launch of it: the file is refused before anything starts.
    ("cluster:\n  local_agents: 2\njob:\n  entrypoint: [python, train.py]\n",
     'job.entrypoint: local agents run only their own interpreter, {python} (a python from PATH is never run): '
     'write ["{python}", "train.py"]'),
])
def test_trainerd_rejects_a_bad_cluster_file(tmp_path: Path, text: str, fragment: str) -> None:
    path = tmp_path / "cluster.yaml"
    path.write_text(text)
    assert_one_line_error(run("trainerd", "start", "--cluster", str(path)), 2, str(path), fragment)


@pytest.mark.parametrize("key", ["listen", "metrics_listen"])
def test_trainerd_on_a_port_that_is_taken_says_which_in_one_line(tmp_path: Path, key: str) -> None:
    taken = free_port()
    addresses = {"listen": f"127.0.0.1:{free_port()}", "metrics_listen": f"127.0.0.1:{free_port()}"}
    addresses[key] = f"127.0.0.1:{taken}"
    path = tmp_path / "cluster.yaml"
    path.write_text(f"cluster:\n  coordinator: {{listen: '{addresses['listen']}', "
                    f"metrics_listen: '{addresses['metrics_listen']}'}}\n")
    with socket.create_server(("127.0.0.1", taken)):
        result = run("trainerd", "start", "--cluster", str(path))
    assert_one_line_error(result, 1, f"trainerd: cannot listen on 127.0.0.1:{taken}: the address is in use",
                          f"(cluster.coordinator.{key})")
    assert "add_port" not in result.stderr  # gRPC's own error lines are not shown: it was not asked
    assert not (tmp_path / "etcd").exists() and "etcd" not in result.stderr  # it stopped before starting one


def test_trainerd_missing_cluster_file(tmp_path: Path) -> None:
    assert_one_line_error(run("trainerd", "start", "--cluster", str(tmp_path / "none.yaml")), 2, "cannot read")


@pytest.mark.parametrize(("argv", "fragment"), [
    (("trainerd", "init"), "No such command 'init'. Did you mean 'trainerd certs init'?"),
    (("trainerd", "node", "--dir", "x", "n1"), "Did you mean 'trainerd certs node'?"),
    (("trainerd", "strat"), "No such command 'strat'. Did you mean 'start'?"),  # click's own, kept
])
def test_trainerd_points_a_command_to_its_group(argv: tuple[str, ...], fragment: str) -> None:
    assert_one_line_error(run(*argv), 2, fragment)


def test_trainerctl_usage_and_unreachable() -> None:
    assert_one_line_error(run("trainerctl", "--coordinator", "nohost", "status"), 2, "not HOST:PORT")
    assert_one_line_error(run("trainerctl", "status", "-o", "yaml"), 2, "'yaml' is not one of")
    result = run("trainerctl", "--coordinator", f"127.0.0.1:{free_port()}", "status")
    assert_one_line_error(result, 3, "cannot reach the coordinator")
    # The connection options work after the command too, as kubectl's do.
    for argv in (("status", "--coordinator", f"127.0.0.1:{free_port()}"),
                 ("logs", "0", f"--coordinator=127.0.0.1:{free_port()}", "--tail", "3")):
        assert_one_line_error(run("trainerctl", *argv), 3, "cannot reach the coordinator")
    assert_one_line_error(run("trainerctl", "status", "--coordinator", "nohost"), 2, "not HOST:PORT")
    assert_one_line_error(run("trainerctl", "--coordinator", "https://10.0.0.5:7420/", "status"), 2,
                          "'https://10.0.0.5:7420/' is a URL, not HOST:PORT: write '10.0.0.5:7420'")


def test_connection_options_move_before_the_command_and_nothing_after_a_double_dash() -> None:
    assert global_options_first(["skips", "add", "1:2", "--reason", "x", "--cert", "a.crt", "--key=a.key",
                                 "--", "--coordinator", "y"]) == [
        "--cert", "a.crt", "--key=a.key", "skips", "add", "1:2", "--reason", "x", "--", "--coordinator", "y"]
    assert global_options_first(["--coordinator", "h:1", "status"]) == ["--coordinator", "h:1", "status"]


def test_agent_rejects_bad_flags(tmp_path: Path) -> None:
    assert_one_line_error(run("trainerd-agent", "--coordinator", "h:0", "--cpu-devices", "1",
                              "--work-dir", str(tmp_path)), 2, "coordinator.0")
    assert_one_line_error(run("trainerd-agent", "--coordinator", "h:1", "--work-dir", str(tmp_path),
                              "--config", str(tmp_path / "missing.yaml")), 2, "cannot read")


@pytest.mark.parametrize(("argv", "fragment"), [
    (("skips", "add", "5", "--reason", "x"), "'5' is not START:END"),
    (("skips", "add", "1:2"), "Missing option '--reason'"),
    (("resume", "--from-step", "0"), "0 is not in the range x>=1"),
    (("nodes", "drain"), "Missing argument 'NAME'"),
    (("drain", "n1"), "No such command 'drain'. Did you mean 'trainerctl nodes drain'?"),
    (("undrain", "n1"), "Did you mean 'trainerctl nodes undrain'?"),
])
def test_trainerctl_refuses_malformed_operator_commands(argv: tuple[str, ...], fragment: str) -> None:
    assert_one_line_error(run("trainerctl", "--coordinator", "127.0.0.1:1", *argv), 2, fragment)


@pytest.mark.parametrize("argv", [("pause",), ("resume",), ("nodes", "undrain", "n1"), ("skips",)])
def test_trainerctl_operator_commands_without_a_coordinator(argv: tuple[str, ...]) -> None:
    assert_one_line_error(run("trainerctl", "--coordinator", f"127.0.0.1:{free_port()}", *argv), 3,
                          "cannot reach the coordinator")


@pytest.fixture(scope="module")
def cert_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("certs")
    result = run("trainerd", "certs", "init", "--dir", str(directory))
    assert result.returncode == 0, result.stderr
    return directory


@pytest.mark.parametrize(("argv", "fragment"), [
    (("init",), "ca.crt already exists (pass --force to replace it)"),
    (("init", "--host", "bad host"), "host 'bad host' is neither an IP address nor a valid DNS name"),
    (("coordinator", "--host", "10.0.0.9"), "coordinator.crt already exists (pass --force to replace it)"),
    (("coordinator", "--host", "bad host", "--force"), "host 'bad host' is neither an IP address nor a valid DNS"),
    (("node", "bad name"), "node name 'bad name' is not valid"),
    (("node", "n1\n"), "node name 'n1\\n' is not valid"),
    (("node", "ca"), "node name 'ca' is reserved"),
    (("operator", ".hidden"), "operator name '.hidden' is not valid"),
])
def test_trainerd_certs_mistakes_are_one_line(cert_dir: Path, argv: tuple[str, ...], fragment: str) -> None:
    result = run("trainerd", "certs", *argv, "--dir", str(cert_dir))
    assert_one_line_error(result, 2, fragment)
    assert len(result.stderr.splitlines()) == 1, result.stderr


@pytest.mark.parametrize("argv", [("node", "n1"), ("coordinator", "--host", "10.0.0.9")])
def test_trainerd_certs_without_a_ca(tmp_path: Path, argv: tuple[str, ...]) -> None:
    result = run("trainerd", "certs", *argv, "--dir", str(tmp_path))
    assert_one_line_error(result, 2, f"{tmp_path / 'ca.crt'} is missing: run `trainerd certs init --dir {tmp_path}`")
    assert len(result.stderr.splitlines()) == 1 and list(tmp_path.iterdir()) == []


def tls_argv(cert_dir: Path, cacert: str | None = "ca.crt", cert: str | None = "coordinator.crt",
             key: str | None = "coordinator.key") -> list[str]:
    argv = []
    for option, name in (("--cacert", cacert), ("--cert", cert), ("--key", key)):
        if name is not None:
            argv += [option, str(cert_dir / name)]
    return argv


@pytest.mark.parametrize(("files", "fragment"), [
    ({"cert": None, "key": None}, "go together: --cert and --key are missing"),
    ({"cacert": None}, "go together: --cacert is missing"),
    ({"key": "absent.key"}, "--key: cannot read"),
    ({"cacert": "coordinator.key"}, "--cacert: {dir}/coordinator.key holds no PEM certificate"),
    ({"key": "ca.key"}, "--key: {dir}/ca.key is not the key of {dir}/coordinator.crt"),
])
@pytest.mark.parametrize("program", ["trainerctl", "trainerd-agent"])
def test_tls_option_mistakes_are_one_line(cert_dir: Path, program: str, files: dict, fragment: str) -> None:
    if program == "trainerctl":
        argv = ["trainerctl", "--coordinator", f"127.0.0.1:{free_port()}", *tls_argv(cert_dir, **files), "status"]
    else:
        argv = ["trainerd-agent", "--coordinator", f"127.0.0.1:{free_port()}", "--cpu-devices", "1",
                "--work-dir", str(cert_dir / "agent"), *tls_argv(cert_dir, **files)]
    result = run(*argv)
    assert_one_line_error(result, 2, fragment.format(dir=cert_dir))
    assert len(result.stderr.splitlines()) == 1, result.stderr


@pytest.mark.parametrize("program", ["trainerctl", "trainerd-agent"])
def test_a_certificate_of_another_ca_is_refused_at_start_in_one_line(cert_dir: Path, tmp_path: Path,
                                                                      program: str) -> None:
    """The coordinator would refuse it in the TLS handshake, which the agent saw only as 'Secure read failed'
    on every try."""
    other = tmp_path / "other"
    for argv in (("init",), ("node", "n1")):
        assert run("trainerd", "certs", *argv, "--dir", str(other)).returncode == 0
    tls = ["--cacert", str(cert_dir / "ca.crt"), "--cert", str(other / "n1.crt"), "--key", str(other / "n1.key")]
    coordinator = f"127.0.0.1:{free_port()}"
    argv = (["trainerctl", "--coordinator", coordinator, *tls, "status"] if program == "trainerctl" else
            ["trainerd-agent", "--coordinator", coordinator, "--node-name", "n1", "--cpu-devices", "1",
             "--work-dir", str(tmp_path / "agent"), *tls])
    result = run(*argv)
    assert_one_line_error(result, 2, f"--cert: {other}/n1.crt was not issued by the CA in {cert_dir}/ca.crt")
    assert len(result.stderr.splitlines()) == 1, result.stderr


def test_tls_options_come_from_the_environment_too(cert_dir: Path) -> None:
    env = {**os.environ, "TRAINERD_CERT": str(cert_dir / "coordinator.crt")}
    result = run("trainerctl", "--coordinator", f"127.0.0.1:{free_port()}", "status", env=env)
    assert_one_line_error(result, 2, "--cacert ($TRAINERD_CACERT), --cert ($TRAINERD_CERT), --key ($TRAINERD_KEY) "
                                     "go together: --cacert and --key are missing")


def test_the_agent_file_tls_keys_are_checked(cert_dir: Path, tmp_path: Path) -> None:
    agent_file = tmp_path / "agent.yaml"
    agent_file.write_text(f"coordinator: [127.0.0.1:{free_port()}]\ncpu_devices: 1\nwork_dir: {tmp_path}\n"
                          f"tls: {{ca_file: {cert_dir}/ca.crt, cert_file: {cert_dir}/coordinator.crt, "
                          f"key_file: {tmp_path}/absent.key}}\n")
    result = run("trainerd-agent", "--config", str(agent_file))
    assert_one_line_error(result, 2, f"{agent_file}: tls.key_file: cannot read {tmp_path}/absent.key")
    assert len(result.stderr.splitlines()) == 1, result.stderr


def test_an_agent_with_a_certificate_that_is_not_its_nodes_refuses_to_start_in_one_line(tmp_path: Path) -> None:
    """The coordinator admits an agent only as the node its certificate names: a wrong certificate (another node's,
    an operator's left in the shell's $TRAINERD_CERT for trainerctl, the coordinator's) is told at start-up, not
    by a PERMISSION_DENIED on every dial."""
    pki = tmp_path / "pki"
    for argv in (("init",), ("node", "n1"), ("operator", "alice")):
        assert run("trainerd", "certs", *argv, "--dir", str(pki)).returncode == 0
    agent = ["trainerd-agent", "--coordinator", f"127.0.0.1:{free_port()}", "--cpu-devices", "1",
             "--work-dir", str(tmp_path / "agent")]
    operator_env = {**os.environ, "TRAINERD_CACERT": str(pki / "ca.crt"), "TRAINERD_CERT": str(pki / "alice.crt"),
                    "TRAINERD_KEY": str(pki / "alice.key")}
    cases = [
        (run(*agent, "--node-name", "n1", env=operator_env),
         f"$TRAINERD_CERT ({pki}/alice.crt; the environment's TLS files override the agent file's) is operator "
         "alice's certificate, not a node's: give this agent node n1's (`trainerd certs node n1`)"),
        (run(*agent, "--node-name", "n2", *tls_argv(pki, cert="n1.crt", key="n1.key")),
         f"--cert {pki}/n1.crt is node n1's certificate, but this agent is node n2: set node_name (--node-name) to "
         "n1, or give it node n2's certificate"),
        (run(*agent, "--node-name", "n1", *tls_argv(pki)),
         f"--cert {pki}/coordinator.crt is not a node certificate of trainerd's"),
    ]
    for result, fragment in cases:
        assert_one_line_error(result, 2, fragment)
        assert len(result.stderr.splitlines()) == 1, result.stderr
    agent_file = tmp_path / "agent.yaml"
    agent_file.write_text(f"coordinator: [127.0.0.1:{free_port()}]\nnode_name: n2\ncpu_devices: 1\n"
                          f"work_dir: {tmp_path / 'agent'}\ntls: {{ca_file: {pki}/ca.crt, cert_file: {pki}/n1.crt, "
                          f"key_file: {pki}/n1.key}}\n")
    assert_one_line_error(run("trainerd-agent", "--config", str(agent_file)), 2,
                          f"{agent_file}: tls.cert_file {pki}/n1.crt is node n1's certificate, but this agent is "
                          "node n2")
