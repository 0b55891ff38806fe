"""The cluster file: defaults, and one clear line naming file and key for every mistake."""

from pathlib import Path

import pytest

from common.config_file import ConfigError
from daemon.config import JobSettings, load_cluster_config

REPO = Path(__file__).resolve().parents[2]


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "cluster.yaml"
    path.write_text(text)
    return path


def test_example_cluster_files_are_valid() -> None:
    examples = sorted((REPO / "configs").glob("cluster*.yaml"))
    assert examples, "configs/ has no example cluster file"
    for example in examples:
        load_cluster_config(example)


def test_defaults_and_relative_paths(tmp_path: Path) -> None:
    config = load_cluster_config(write(tmp_path, "cluster:\n  name: demo\n  local_agents: 2\n"))
    assert config.cluster.etcd.endpoints == []
    assert config.cluster.local_agents == 2
    assert config.resolve(config.cluster.etcd.data_dir) == tmp_path / "run/etcd"
    assert config.cluster.coordinator.advertised == config.cluster.coordinator.listen
    # State in etcd is bounded by default.
    assert (config.cluster.events.keep, config.cluster.events.max_age_s) == (10000, 7 * 86400)
    assert config.cluster.heartbeat.forget_lost_after_s == 86400
    assert config.cluster.coordinator.max_sessions == 20000


@pytest.mark.parametrize(("local_agents", "workdir", "expected"), [
    (2, None, "."),  # one machine: where the cluster file is, as msrun runs a script where it is started
    (0, None, None),  # across hosts: each agent's per-job directory
    (2, "runs/a", "runs/a"),
    (0, "/srv/b", "/srv/b"),
])
def test_the_jobs_working_directory(tmp_path: Path, local_agents: int, workdir: str | None,
                                    expected: str | None) -> None:
    job = "job:\n  entrypoint: ['{python}', train.py]\n" + (f"  workdir: {workdir}\n" if workdir else "")
    config = load_cluster_config(write(tmp_path, f"cluster:\n  local_agents: {local_agents}\n" + job))
    assert config.job is not None
    assert config.job.workdir == (None if expected is None else str((tmp_path / expected).resolve()))


def test_a_script_argument_that_names_msrun_is_no_msrun_entrypoint() -> None:
    settings = JobSettings(entrypoint=["{python}", "train.py", "--launcher", "msrun"])
    assert settings.entrypoint == ["{python}", "train.py", "--launcher", "msrun"]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("cluster:\n  heartbeat:\n    interval_s: fast\n", "cluster.heartbeat.interval_s: Input should be a valid number"),
        ("cluster:\n  bogus: 1\n", "cluster.bogus: unknown key"),
        ("cluster:\n  heartbeat:\n    intervl_s: 1\n", "cluster.heartbeat.intervl_s: unknown key (did you mean interval_s?)"),
        ("job:\n  entrypoint: [a]\n  max_node: 2\n", "job.max_node: unknown key (did you mean max_nodes?)"),
        ("cluster: [1\n", "malformed YAML at line"),
        ("- a\n- b\n", "top level must be a mapping"),
        ("cluster:\n  coordinator:\n    listen: nohost\n", "cluster.coordinator.listen: 'nohost' is not HOST:PORT"),
        ("cluster:\n  etcd:\n    endpoints: ['a:1', 'b:99999']\n", "cluster.etcd.endpoints.1: 'b:99999' has no valid port"),
        ("cluster:\n  heartbeat:\n    interval_s: 2\n    timeout_s: 3\n", "cluster.heartbeat: timeout_s must be at least twice"),
        ("cluster:\n  local_agents: '2'\n", "cluster.local_agents: Input should be a valid integer"),
        ("cluster:\n  etcd:\n    username: u\n", "cluster.etcd: username and password go together"),
        ("cluster:\n  name: 'a b'\n", "cluster.name: String should match pattern"),
        ("cluster:\n  events:\n    keep: 10\n", "cluster.events.keep: Input should be greater than or equal to 100"),
        ("cluster:\n  events:\n    max_age_days: 0\n", "cluster.events.max_age_days: Input should be greater than 0"),
        ("cluster:\n  heartbeat:\n    forget_lost_after_s: 5\n",
         "cluster.heartbeat.forget_lost_after_s: Input should be greater than or equal to 60"),
        ("cluster:\n  coordinator:\n    max_sessions: 0\n",
         "cluster.coordinator.max_sessions: Input should be greater than or equal to 1"),
    ],
)
def test_mistakes_name_file_and_key(tmp_path: Path, text: str, expected: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_cluster_config(path)
    message = str(info.value)
    assert message.startswith(f"{path}: ")
    assert expected in message
    assert "\n" not in message


def test_missing_file_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_cluster_config(tmp_path / "absent.yaml")


def test_the_example_cluster_file_is_valid() -> None:
    config = load_cluster_config(Path(__file__).parents[2] / "configs" / "cluster.example.yaml")
    assert config.job.allowed_world_sizes() == [32, 16]
    assert config.job.checkpoint.dir == "/mnt/shared/checkpoints/mlp"


def test_the_script_example_runs_where_it_is_on_one_machine() -> None:
    """Copied beside a train.py and started as it is (local agents), it runs that train.py."""
    configs = Path(__file__).parents[2] / "configs"
    config = load_cluster_config(configs / "cluster.script.yaml")
    assert config.cluster.local_agents and config.job.workdir == str(configs)
    assert config.job.entrypoint[:2] == ["{python}", "train.py"]


JOB = "job:\n  entrypoint: ['{python}', 'train.py']\n"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (JOB + "  global_batch: 64\n", "job: global_batch and micro_batch go together"),
        ("job:\n  entrypoint: \"{python} train.py --name 'my run'\"\n",
         'job.entrypoint: must be a list of words, no shell runs it: write ["{python}", "train.py", "--name", '
         '"my run"]'),
        ("job:\n  entrypoint: \"{python} train.py --name 'unclosed\"\n",
         'job.entrypoint: must be a list of words, no shell runs it: write ["{python}", "train.py", "--name", '
         '"\'unclosed"]'),
        ('job:\n  entrypoint: [msrun, --worker_num=8, --local_worker_num, "8", --join=True, train.py, --epochs, "3"]\n',
         'job.entrypoint: runs msrun, which starts the scheduler and workers itself: trainerd starts them (each with '
         'msrun\'s environment), so give the command msrun runs, ["{python}", "train.py", "--epochs", "3"], and the '
         'world size as max_nodes x devices_per_node (msrun\'s --worker_num)'),
        ('job:\n  entrypoint: ["{python}", -m, mindspore.parallel.cluster.run, --master_port, "8118", run.sh]\n',
         'give the command msrun runs, ["run.sh"], and'),
        ('job:\n  entrypoint: ["{python}", /opt/venv/bin/msrun, --worker_num=2, pretrain.py]\n',
         'give the command msrun runs, ["{python}", "pretrain.py"], and'),
        (JOB + "  progress_pattern: 'loss (?P<loss>\\S+)'\n", "job: progress_pattern: needs a named group 'step' (or 'global_step')"),
        (JOB + "  progress_pattern: '(?P<step>\\d+'\n", "job: progress_pattern: not a valid regular expression"),
        (JOB + "  progress_pattern: '(?P<step>\\d+) (?P<lr>\\S+)'\n", "job: progress_pattern: unknown named group 'lr'"),
        (JOB + "  graceful_exit_file: ''\n", "job: graceful_exit_file must not be empty"),
        ("job:\n  entrypoint: python3 train.py --epochs 10\n",  # the suggestion is what then runs
         'job.entrypoint: must be a list of words, no shell runs it: write ["{python}", "train.py", "--epochs", "10"]'),
        ("cluster:\n  coordinator: {listen: '127.0.0.1:7420', metrics_listen: '127.0.0.1:7420'}\n",
         "cluster: coordinator.metrics_listen 127.0.0.1:7420 is the address of coordinator.listen too: give each its "
         "own port"),
        ("cluster:\n  coordinator: {listen: '127.0.0.1:2379'}\n",  # the embedded etcd's default client port
         "cluster: etcd.client_listen 127.0.0.1:2379 is the address of coordinator.listen too"),
        ("cluster:\n  insecure: true\n  coordinator: {listen: '0.0.0.0:9000', metrics_listen: '127.0.0.1:9000'}\n",
         "coordinator.metrics_listen 127.0.0.1:9000 is the address of coordinator.listen too"),
        ("job:\n  entrypiont: ['{python}', train.py]\n",  # a misspelt key, not the "Field required" it causes
         "job.entrypiont: unknown key (did you mean entrypoint?) (and 1 more problem)"),
        ("cluster:\n  local_agents: 2\njob:\n  entrypoint: [/usr/bin/python3, train.py]\n",
         'job.entrypoint: local agents run only their own interpreter, {python} (a python from PATH is never run): '
         'write ["{python}", "train.py"]'),
        ("cluster:\n  local_agents: 2\n" + JOB + "  node_check: [/opt/bin/check.sh]\n",
         'job.node_check: local agents run only their own interpreter, {python} (a python from PATH is never run): '
         'run a Python script as ["{python}", "SCRIPT", ...], or start trainerd-agent on the host yourself'),
        (JOB + "  env: {LD_PRELOAD: /tmp/x.so}\n", "job: env may not set LD_PRELOAD: it loads code or configuration"),
        (JOB + "  env: {PYTHONPATH: /tmp}\n", "job: env may not set PYTHONPATH: it loads code or configuration"),
        # issue 47: an exported bash function ran as root through a bash entrypoint; names must be identifiers
        (JOB + "  env: {'BASH_FUNC_ls%%': '() { id; }'}\n", "job: env may not set BASH_FUNC_ls%%: a variable's name"),
        (JOB + "  env: {'A=B': x}\n", "job: env may not set A=B: a variable's name is a letter or _"),
        (JOB + "  env: {PYTHONWARNINGS: 'ignore::evil.Category'}\n", "job: env may not set PYTHONWARNINGS: it loads"),
        (JOB + "  env: {PATH: /tmp/bin}\n", "job: env may not set PATH: it loads code"),
        (JOB + "  env: {ASCEND_CUSTOM_OPP_PATH: /tmp/ops}\n", "job: env may not set ASCEND_CUSTOM_OPP_PATH: it loads"),
        (JOB + "  env: {TRAINERD_DEBUG: '1'}\n", "job: env may not set TRAINERD_DEBUG: TRAINERD_ names are trainerd's"),
        (JOB + "  data_skip:\n    spike_zscore: .inf\n", "job.data_skip.spike_zscore: Input should be a finite number"),
        (JOB + "  data_skip:\n    spike_ceiling: 1\n", "job.data_skip.spike_ceiling: Input should be greater than 1"),
        (JOB + "  data_skip:\n    warmup_steps: 0\n",
         "job.data_skip.warmup_steps: Input should be greater than or equal to 1"),
        (JOB + "  checkpoint:\n    memory_every_steps: often\n",
         'job.checkpoint.memory_every_steps: must be a number of steps (0: never) or "auto", got \'often\''),
        (JOB + "  checkpoint:\n    memory_every_steps: -1\n",
         'job.checkpoint.memory_every_steps: must be a number of steps (0: never) or "auto", got -1'),
    ],
)
def test_job_mistakes_name_the_key(tmp_path: Path, text: str, expected: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_cluster_config(path)
    assert expected in str(info.value)
    assert "\n" not in str(info.value)


def test_agents_of_ones_own_may_be_allowed_other_entrypoints(tmp_path: Path) -> None:
    config = load_cluster_config(write(tmp_path, "job:\n  entrypoint: [/opt/bin/run.sh, --fast]\n"))
    assert config.job.entrypoint == ["/opt/bin/run.sh", "--fast"]  # each agent's allowed_entrypoints decides


def test_a_script_that_does_its_own_batching_needs_no_batch_settings(tmp_path: Path) -> None:
    config = load_cluster_config(write(tmp_path, JOB + "  max_nodes: 3\n  workdir: jobdir\n"))
    job = config.job
    assert job.global_batch is None and job.micro_batch is None
    assert job.allowed_world_sizes() == [3, 2, 1]
    assert job.grad_accum(3) == 1
    assert job.workdir == str(tmp_path / "jobdir")  # resolved once, like checkpoint.dir


@pytest.mark.parametrize(("text", "every"), [("", "auto"), ("auto", "auto"), ("0", 0), ("25", 25)])
def test_memory_snapshots_are_automatic_unless_a_number_of_steps_is_given(
        tmp_path: Path, text: str, every: int | str) -> None:
    setting = f"  checkpoint:\n    memory_every_steps: {text}\n" if text else ""
    assert load_cluster_config(write(tmp_path, JOB + setting)).job.checkpoint.memory_every_steps == every


def test_a_progress_pattern_with_step_is_accepted(tmp_path: Path) -> None:
    config = load_cluster_config(write(
        tmp_path, JOB + "  progress_pattern: 'it (?P<step>\\d+) loss=(?P<loss>\\S+)'\n"))
    assert config.job.progress_pattern == r"it (?P<step>\d+) loss=(?P<loss>\S+)"


TLS = "  tls: {ca_file: pki/ca.crt, cert_file: pki/coordinator.crt, key_file: pki/coordinator.key}\n"


@pytest.mark.parametrize(("text", "expected"), [
    ("cluster:\n  coordinator: {listen: '0.0.0.0:7420'}\n",
     "cluster: coordinator.listen 0.0.0.0:7420 is not a loopback address: give tls"),
    ("cluster:\n  coordinator: {listen: '10.0.0.5:7420'}\n  insecure: false\n",
     "cluster: coordinator.listen 10.0.0.5:7420 is not a loopback address"),
    ("cluster:\n  coordinator: {listen: 'head.example.org:7420'}\n",
     "cluster: coordinator.listen head.example.org:7420 is not a loopback address"),
    ("cluster:\n  coordinator: {listen: '[::]:7420'}\n", "cluster: coordinator.listen [::]:7420 is not a loopback"),
    ("cluster:\n  coordinator: {metrics_listen: '0.0.0.0:9100'}\n",
     "cluster: coordinator.metrics_listen 0.0.0.0:9100 is not a loopback address"),
    ("cluster:\n  etcd: {client_listen: '0.0.0.0:2379'}\n",
     "cluster: etcd.client_listen 0.0.0.0:2379 is not a loopback address and the embedded etcd serves TLS only "
     "with tls: give tls"),
    ("cluster:\n  etcd: {peer_listen: '10.0.0.5:2380'}\n",
     "cluster: etcd.peer_listen 10.0.0.5:2380 is not a loopback address"),
    ("cluster:\n  etcd: {client_listen: '0.0.0.0:2379', peer_listen: '0.0.0.0:2380'}\n" + TLS,
     "cluster: etcd.peer_listen 0.0.0.0:2380 is not a loopback address: the embedded etcd has no peers"),
    ("cluster:\n  insecure: true\n" + TLS, "cluster: tls and insecure: true contradict each other"),
    ("cluster:\n  local_agents: 2\n" + TLS, "cluster: local_agents connect without certificates"),
    ("cluster:\n  tls: {ca_file: ca.crt, cert_file: c.crt}\n", "cluster.tls.key_file: Field required"),
    ("cluster:\n  insecure: 'yes'\n", "cluster.insecure: Input should be a valid boolean"),
    ("cluster:\n  join: {listen: '127.0.0.1:7421', ca_key_file: ca.key}\n", "cluster: join needs tls"),
    ("cluster:\n  join: {listen: '127.0.0.1:7420', ca_key_file: ca.key}\n" + TLS,
     "cluster: join.listen 127.0.0.1:7420 is the address of coordinator.listen too"),
    ("cluster:\n  join: {listen: '127.0.0.1:7421'}\n" + TLS, "cluster.join.ca_key_file: Field required"),
])
def test_a_listener_off_loopback_needs_tls_or_insecure_in_so_many_words(
    tmp_path: Path, text: str, expected: str
) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_cluster_config(path)
    assert str(info.value).startswith(f"{path}: {expected}")
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("text", [
    "cluster:\n  coordinator: {listen: '127.0.0.1:7420', metrics_listen: 'localhost:9100'}\n  local_agents: 2\n",
    "cluster:\n  coordinator: {listen: '[::1]:7420'}\n  etcd: {client_listen: '127.0.0.2:2379'}\n",
    "cluster:\n  coordinator: {listen: '0.0.0.0:7420', metrics_listen: '0.0.0.0:9100'}\n" + TLS,
    "cluster:\n  coordinator: {listen: '0.0.0.0:7420'}\n  etcd: {endpoints: ['10.0.0.1:2379']}\n" + TLS,
    "cluster:\n  coordinator: {listen: '0.0.0.0:7420'}\n  etcd: {client_listen: '0.0.0.0:2379'}\n" + TLS,
    "cluster:\n  coordinator: {listen: '0.0.0.0:7420'}\n  etcd: {client_listen: '0.0.0.0:2379'}\n"
    "  local_agents: 1\n  insecure: true\n",
])
def test_loopback_tls_or_insecure_are_accepted(tmp_path: Path, text: str) -> None:
    load_cluster_config(write(tmp_path, text))


def test_tls_files_are_taken_from_the_cluster_files_directory(tmp_path: Path) -> None:
    config = load_cluster_config(write(tmp_path, "cluster:\n  coordinator: {listen: '0.0.0.0:7420'}\n" + TLS))
    assert config.cluster.tls is not None
    assert (config.cluster.tls.ca_file, config.cluster.tls.key_file) == (
        str(tmp_path / "pki/ca.crt"), str(tmp_path / "pki/coordinator.key"))


def test_the_ca_key_of_join_is_taken_from_the_cluster_files_directory(tmp_path: Path) -> None:
    config = load_cluster_config(write(tmp_path, "cluster:\n  join: {listen: '0.0.0.0:7421', ca_key_file: pki/ca.key}\n"
                                       + TLS))
    assert config.cluster.join is not None and config.cluster.join.ca_key_file == str(tmp_path / "pki/ca.key")


@pytest.mark.parametrize("text", [
    # the same port on two addresses of the host
    "cluster:\n  insecure: true\n  coordinator: {listen: '10.0.0.1:7420', metrics_listen: '127.0.0.1:7420'}\n",
    # an etcd of the operator's: the embedded one's default ports are not trainerd's
    "cluster:\n  coordinator: {listen: '127.0.0.1:2379'}\n  etcd: {endpoints: ['10.0.0.5:2379']}\n",
])
def test_listeners_on_addresses_of_their_own_are_accepted(tmp_path: Path, text: str) -> None:
    load_cluster_config(write(tmp_path, text))
