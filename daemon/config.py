"""The cluster file (`trainerd start --cluster cluster.yaml`): schema, defaults and validation."""

from __future__ import annotations

import datetime
import json
import shlex
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from common.config_file import (
    Address,
    ConfigError,
    StrictModel,
    is_loopback,
    load_yaml_mapping,
    parse_host_port,
    validate,
)
from common.tls_files import TlsSettings
from daemon.msrun_entrypoint import script_msrun_runs
from proto.launch_env import RESERVED_ENV, forbidden_job_env
from proto.progress_pattern import compile_progress_pattern
from proto.vocabulary import (
    DEFAULT_ALLOWED_ENTRYPOINTS,
    PYTHON_WORD,
    names_a_python,
    starts_with_one_of,
    with_python,
)


class CoordinatorSettings(StrictModel):
    listen: Address = "127.0.0.1:7420"
    # Where agents and trainerctl reach this coordinator; defaults to `listen`.
    advertise: Address | None = None
    # TTL of the leader lease: a standby takes over at most this long after the leader dies.
    leader_lease_s: int = Field(default=3, ge=2, le=60)
    # Prometheus metrics (HOST:PORT); none when unset.
    metrics_listen: Address | None = None
    # Agent session streams open at once; more are refused (RESOURCE_EXHAUSTED).
    max_sessions: int = Field(default=20000, ge=1, le=1_000_000)
    # Sessions being opened at once (Hello read, Welcome not yet sent); past it a Hello is deferred at
    # once with a retry-after ticket of its own (daemon/admission.py OpeningGate).
    max_opening_sessions: int = Field(default=256, ge=1, le=1_000_000)

    @property
    def advertised(self) -> str:
        return self.advertise or self.listen


class EtcdSettings(StrictModel):
    endpoints: list[Address] = []
    # Embedded single-node etcd (used when `endpoints` is empty).
    data_dir: str = "run/etcd"
    client_listen: Address = "127.0.0.1:2379"
    peer_listen: Address = "127.0.0.1:2380"
    # Production etcd: TLS and user/password.
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    username: str | None = None
    password: str | None = None

    @model_validator(mode="after")
    def _credentials_in_pairs(self) -> "EtcdSettings":
        if (self.username is None) != (self.password is None):
            raise ValueError("username and password go together")
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("cert_file and key_file go together")
        return self


class HeartbeatSettings(StrictModel):
    interval_s: float = Field(default=1.0, gt=0, le=60)
    # A node not heard from for this long is LOST (a host that lost power breaks no connection).
    timeout_s: float = Field(default=5.0, gt=0, le=600)
    # The most heartbeats a second the leader takes: with more agents than interval_s * max_per_s, the
    # interval and the timeout stretch together until they fit (daemon/heartbeat_pace.py).
    max_per_s: float = Field(default=2000.0, gt=0)
    # A node whose session broke is LOST unless it reconnects within this long (default: two
    # heartbeat intervals, enough for an agent's reconnect, which backs off at most one interval).
    session_grace_s: float | None = Field(default=None, gt=0, le=600)
    # A node LOST for this long leaves the membership records (its history stays in the events).
    forget_lost_after_s: float = Field(default=86400.0, ge=60)

    @model_validator(mode="after")
    def _timeout_covers_intervals(self) -> "HeartbeatSettings":
        if self.timeout_s < 2 * self.interval_s:
            raise ValueError("timeout_s must be at least twice interval_s")
        if self.session_grace_s is not None and self.session_grace_s > self.timeout_s:
            raise ValueError("session_grace_s must not exceed timeout_s")
        return self

    @property
    def grace_s(self) -> float:
        return self.session_grace_s if self.session_grace_s is not None else 2 * self.interval_s


class EventSettings(StrictModel):
    """The job's event log in etcd is bounded: the leader deletes the oldest events."""

    # At most this many events are kept...
    keep: int = Field(default=10000, ge=100, le=1_000_000)
    # ... and none older than this (the newest event always stays).
    max_age_days: float = Field(default=7.0, gt=0, le=3650)

    @property
    def max_age_s(self) -> float:
        return self.max_age_days * 86400


class LocalAgentSettings(StrictModel):
    """Agents that `trainerd` itself starts on this host (single-machine mode)."""

    work_dir: str = "run/agents"
    cpu_devices: int = Field(default=1, ge=1, le=64)
    # The agents' compile cache (agent file `compile_cache`): only for a job whose step is a Cell.
    compile_cache: bool = False
    # The agents' warm workers (agent file `warm_workers`): a relaunch starts in pre-started interpreters.
    warm_workers: bool = True


class JoinSettings(StrictModel):
    """Hosts join with a token (`trainerctl tokens create`) instead of copied files: the coordinator signs
    their node certificates with the CA's key. Needs tls."""

    # Where joining agents (which have no certificate yet) reach the coordinator: TLS with its certificate,
    # no client certificate, the Bootstrap service alone.
    listen: Address
    # The CA's private key (`trainerd certs init` wrote it as ca.key beside ca.crt). Whoever reads it can
    # make any certificate of the cluster: keep it readable by trainerd's user alone.
    ca_key_file: str
    # How long a node certificate issued to a joining or renewing agent is valid (from an hour before it is
    # made, for hosts whose clock is behind); agents renew theirs over their session once less than a third
    # of this is left.
    certificate_days: float = Field(default=30.0, ge=0.05, le=825.0)

    @property
    def certificate_validity(self) -> datetime.timedelta:
        return datetime.timedelta(days=self.certificate_days)


# Hosts a listener binds on every address of its family.
WILDCARD_HOSTS = frozenset({"0.0.0.0", "::", ""})


class ClusterSettings(StrictModel):
    name: str = Field(default="trainerd", min_length=1, pattern=r"^[A-Za-z0-9_.-]+$")
    coordinator: CoordinatorSettings = CoordinatorSettings()
    etcd: EtcdSettings = EtcdSettings()
    heartbeat: HeartbeatSettings = HeartbeatSettings()
    events: EventSettings = EventSettings()
    local_agents: int = Field(default=0, ge=0, le=64)
    local_agent: LocalAgentSettings = LocalAgentSettings()
    # The coordinator's TLS: it serves the CA's certificate for it and admits only clients (agents,
    # operators) whose certificate that CA signed. Required on any listener that is not loopback...
    tls: TlsSettings | None = None
    # ... unless this says, in so many words, that the cluster's network is trusted with plain text.
    insecure: bool = False
    # Joining hosts with a token; none: only with files made by `trainerd certs node`.
    join: JoinSettings | None = None

    @model_validator(mode="after")
    def _one_listener_per_address(self) -> "ClusterSettings":
        """trainerd's own listeners (the coordinator's, its metrics', the embedded etcd's) each need an address
        of their own; a wildcard host (0.0.0.0, ::) takes its port on every address."""
        listeners = {"coordinator.listen": self.coordinator.listen,
                     "coordinator.metrics_listen": self.coordinator.metrics_listen,
                     "join.listen": None if self.join is None else self.join.listen}
        if not self.etcd.endpoints:
            listeners |= {"etcd.client_listen": self.etcd.client_listen, "etcd.peer_listen": self.etcd.peer_listen}
        seen: dict[tuple[str, int], str] = {}
        for key, address in listeners.items():
            if address is None:
                continue
            host, port = parse_host_port(address)
            for (other_host, other_port), other_key in seen.items():
                if port == other_port and (host == other_host or {host, other_host} & WILDCARD_HOSTS):
                    raise ValueError(f"{key} {address} is the address of {other_key} too: give each its own port")
            seen[(host, port)] = key
        return self

    @model_validator(mode="after")
    def _secure_unless_loopback(self) -> "ClusterSettings":
        if self.join is not None and self.tls is None:
            raise ValueError("join needs tls: a joining host gets a certificate of the cluster's CA")
        if self.tls is not None and self.insecure:
            raise ValueError("tls and insecure: true contradict each other: leave one out")
        if self.tls is not None and self.local_agents:
            raise ValueError("local_agents connect without certificates: run them without tls, on a loopback "
                             "coordinator.listen")
        if self.insecure:
            return self
        if not self.etcd.endpoints:
            if not is_loopback(self.etcd.peer_listen):
                raise ValueError(f"etcd.peer_listen {self.etcd.peer_listen} is not a loopback address: the embedded "
                                 f"etcd has no peers and serves its peer port plain: keep it on 127.0.0.1")
            if self.tls is None and not is_loopback(self.etcd.client_listen):
                raise ValueError(
                    f"etcd.client_listen {self.etcd.client_listen} is not a loopback address and the embedded etcd "
                    f"serves TLS only with tls: give tls, keep it on 127.0.0.1, or write insecure: true")
        if self.tls is None:
            listeners = {"coordinator.listen": self.coordinator.listen,
                         "coordinator.metrics_listen": self.coordinator.metrics_listen}
            for key, address in listeners.items():
                if address is not None and not is_loopback(address):
                    raise ValueError(
                        f"{key} {address} is not a loopback address: give tls (ca_file, cert_file, key_file; "
                        f"`trainerd certs init` makes them) or write insecure: true to serve plain text")
        return self


class CheckpointSettings(StrictModel):
    # Root of the job's checkpoints, on storage every node mounts (default: run/checkpoints/<job>).
    dir: str | None = None
    # Workers save every this many optimizer steps (0: only when trainerd asks, before growing).
    every_steps: int = Field(default=100, ge=0)
    keep: int = Field(default=3, ge=1, le=1000)
    # Workers also snapshot their state into their agent's shared memory every this many steps (0: never),
    # so that a worker crash loses at most that many steps (docs/concepts/snapshots.md). "auto": as
    # often as keeps the snapshot's stall under 2% of the step time, as the workers measure it, and at most
    # one per 10 s of training (trainer/runtime/snapshot_interval.py), never further apart than 1000 steps
    # or every_steps. A generation spanning hosts takes them only when every node's agent serves SnapshotPeer
    # (launch_plan.py).
    memory_every_steps: int | Literal["auto"] = "auto"
    # Who writes the disk checkpoints. "worker": each rank copies its share to host memory and a thread of
    # its own writes it. "agent": each rank writes its share into shared memory its agent owns and returns,
    # and the agent saves it to disk, off the worker's process (agent/snapshots/checkpoint_persister.py); a worker
    # crash then loses no save it began. Checkpoints are the same either way; for trainerd's runtime only
    # (MindFormers saves its own).
    saved_by: Literal["worker", "agent"] = "worker"

    @field_validator("memory_every_steps", mode="before")
    @classmethod
    def _steps_or_auto(cls, value: object) -> object:
        """One error that says what is allowed (the union alone would report a problem per member)."""
        if value == "auto" or (type(value) is int and value >= 0):
            return value
        raise ValueError(f'must be a number of steps (0: never) or "auto", got {value!r:.40}')


class RestartSettings(StrictModel):
    """Crashes (not membership changes) spend the budget; `trainerctl resume` refills it."""

    max: int = Field(default=10, ge=0)
    # Wait before relaunching after a crash: backoff_s, doubling per consecutive crash, capped.
    backoff_s: float = Field(default=1.0, ge=0, le=3600)
    max_backoff_s: float = Field(default=60.0, ge=0, le=3600)
    # A node whose processes crash this many times is left out of later generations.
    quarantine_after: int = Field(default=3, ge=1)


class DataSkipSettings(StrictModel):
    """Bad batches. The spike rule is trainer/runtime/guard_policy.py's: with g
    the running geometric mean of the gradient norm, a norm above spike_ceiling x g is a spike, one at most
    spike_factor x g is not, and in between it is one when its log is over spike_zscore standard deviations
    above the mean of log(norm)."""

    spike_factor: float = Field(default=12.0, gt=1)  # .inf turns spike detection off
    spike_zscore: float = Field(default=8.0, gt=0, allow_inf_nan=False)
    spike_ceiling: float = Field(default=50.0, gt=1, allow_inf_nan=False)
    # A step the guard refused is computed again; a reproduced spike is bad data only when its loss stands out:
    # above loss_factor x the running geometric mean of the loss and more than loss_zscore standard deviations
    # of log(loss) above its mean. Otherwise it is a healthy excursion of the norm, and is applied.
    loss_factor: float = Field(default=2.0, gt=1, allow_inf_nan=False)
    # The standard deviations of log(loss) a reproduced spike's loss must stand above its mean (see loss_factor).
    loss_zscore: float = Field(default=4.0, gt=0, allow_inf_nan=False)
    # Accepted steps before spikes are looked for (the workers need at least one to have a mean).
    warmup_steps: int = Field(default=10, ge=1)
    max_consecutive_spikes: int = Field(default=10, ge=1)
    # The same step crashing a worker this many times makes its samples skipped.
    crash_repeats: int = Field(default=2, ge=1)
    # Once the skip ledger holds MIN_RANGES_FOR_FRACTION ranges (daemon/job/decide.py), more than this
    # fraction of the samples trained on skipped as bad fails the job: the data, the model or a device is
    # broken, and skipping on would only burn the data and the hours.
    max_skipped_fraction: float = Field(default=0.05, gt=0, le=1)


class JobSettings(StrictModel):
    """The training job: what to run, on how many devices, with which batch."""

    name: str = Field(default="job", min_length=1, pattern=r"^[A-Za-z0-9_.-]+$")
    # argv of every process; "{python}" stands for the agent's own interpreter.
    entrypoint: list[str] = Field(min_length=1)
    env: dict[str, str] = {}

    @field_validator("entrypoint", mode="before")
    @classmethod
    def _words(cls, value: object) -> object:
        """A command line written as one string gets the list it should be, to copy (no shell runs it)."""
        if isinstance(value, str):
            try:
                words = shlex.split(value)
            except ValueError:
                words = value.split()
            raise ValueError(f"must be a list of words, no shell runs it: write {json.dumps(with_python(words))}")
        return value

    @field_validator("entrypoint")
    @classmethod
    def _not_msrun(cls, value: list[str]) -> list[str]:
        """msrun would start a cluster of its own in every process the agents start."""
        script = script_msrun_runs(value)
        if script is not None:
            raise ValueError(f"runs msrun, which starts the scheduler and workers itself: trainerd starts them (each "
                             f"with msrun's environment), so give the command msrun runs, {json.dumps(script)}, and "
                             f"the world size as max_nodes x devices_per_node (msrun's --worker_num)")
        return value
    devices_per_node: int = Field(default=1, ge=1, le=64)
    min_nodes: int = Field(default=1, ge=1)
    max_nodes: int = Field(default=1, ge=1)
    world_size_multiple_of: int = Field(default=1, ge=1)
    # READY nodes kept out of the placement to stand by: a lost node is replaced by one at the same world size
    # (no reshard), and a node that returns refills them before the job grows. Held back only while the rest
    # still makes a placement: a job short of nodes runs on its spares rather than wait.
    spare_nodes: int = Field(default=0, ge=0, le=1024)
    # The batch split trainerd keeps across world sizes (gradient accumulation = global / (micro x
    # world size)). Optional: a script that does its own batching sets neither.
    global_batch: int | None = Field(default=None, ge=1)
    micro_batch: int | None = Field(default=None, ge=1)
    # The processes' working directory, the same for every generation, so a script's relative paths
    # (its data, its own checkpoints) stay put across restarts. Default: the cluster file's directory with
    # local_agents (one machine, as msrun), else a per-job directory under each agent's work dir. A
    # relative path is taken from the cluster file's directory.
    workdir: str | None = None
    # A regex with named groups (step required; epoch, loss, samples_per_s optional) that finds
    # progress in a rank's output, for scripts that print neither LossMonitor nor TimeMonitor lines.
    progress_pattern: str | None = None
    # The file the script's MindSpore OnRequestExit callback watches (relative to workdir), for
    # scripts that use MindSpore's graceful exit: a drain or growth then stops every rank at the
    # same step boundary instead of killing it mid-step.
    graceful_exit_file: str | None = None
    # argv run by the agent on a host that returns from LOST or a quarantine, before it is offered work
    # (on Ascend e.g. MindSpore's stress_detect); exit 0 passes. "{python}": the agent's interpreter.
    # It must start with one of the agent's allowed_entrypoints. None: no check.
    node_check: list[str] | None = Field(default=None, min_length=1)
    # A node check still running after this long is killed and counts as failed.
    node_check_timeout_s: float = Field(default=300.0, gt=0, le=3600)
    # Port of the MindSpore scheduler on the first node of each generation.
    scheduler_port: int = Field(default=8118, ge=1024, le=65535)
    # Once min_nodes are READY, wait this long for more before the first launch.
    start_wait_s: float = Field(default=10.0, ge=0)
    # SIGTERM, then SIGKILL after this long, when a generation is stopped.
    stop_grace_s: float = Field(default=5.0, gt=0, le=300)
    # No rank reporting a new step for this long (from launch, so it covers start-up) is a hang. It is the
    # allowance while the generation compiles and warms up (its first 20 new steps), before a step that saves
    # a checkpoint or snapshot (or while a requested save is pending), during an evaluation, as a new epoch
    # begins, and always for steps read from a script's output; otherwise it caps the adaptive allowance below.
    hang_timeout_s: float = Field(default=300.0, gt=0)
    # Once the generation's step time is measured, a hang is judged after 10 x the slowest of its last 100
    # intervals between new steps, but never sooner than this: a fast job's hang is seen in this many seconds,
    # and a step that stalls (a collective's retry over a bad link, a slow batch, a busy host) has this much
    # room before every process is restarted for it. Lower it for a job whose steps never stall
    # (docs/concepts/recovery.md).
    hang_floor_s: float = Field(default=30.0, gt=0)
    checkpoint: CheckpointSettings = CheckpointSettings()
    restart: RestartSettings = RestartSettings()
    data_skip: DataSkipSettings = DataSkipSettings()

    @model_validator(mode="after")
    def _batch_fits_some_world_size(self) -> "JobSettings":
        reserved = sorted(RESERVED_ENV & self.env.keys())
        if reserved:
            raise ValueError(f"env may not set {', '.join(reserved)}: trainerd sets them per process")
        for name in sorted(self.env):
            if (reason := forbidden_job_env(name)) is not None:
                raise ValueError(f"env may not set {name}: {reason}")
        if self.max_nodes < self.min_nodes:
            raise ValueError("max_nodes must be at least min_nodes")
        if (self.global_batch is None) != (self.micro_batch is None):
            raise ValueError("global_batch and micro_batch go together (or leave both out)")
        if self.progress_pattern is not None:
            try:
                compile_progress_pattern(self.progress_pattern)
            except ValueError as exc:
                raise ValueError(f"progress_pattern: {exc}") from None
        if self.graceful_exit_file is not None and not self.graceful_exit_file.strip():
            raise ValueError("graceful_exit_file must not be empty")
        if not self.allowed_world_sizes():
            if self.global_batch is None:
                raise ValueError(
                    f"no world size is a multiple of {self.world_size_multiple_of} between "
                    f"{self.min_nodes * self.devices_per_node} and {self.max_nodes * self.devices_per_node}")
            raise ValueError(
                f"global_batch {self.global_batch} cannot be kept by any allowed world size: it must be a "
                f"multiple of micro_batch ({self.micro_batch}) x world size, with world size a multiple of "
                f"{self.world_size_multiple_of} between {self.min_nodes * self.devices_per_node} and "
                f"{self.max_nodes * self.devices_per_node}")
        return self

    def allowed_world_sizes(self) -> list[int]:
        """World sizes that satisfy every rule and keep the global batch exact, largest first."""
        sizes = range(self.max_nodes * self.devices_per_node, self.min_nodes * self.devices_per_node - 1, -1)
        return [w for w in sizes if w % self.world_size_multiple_of == 0 and self.keeps_batch(w)]

    def keeps_batch(self, world_size: int) -> bool:
        if self.global_batch is None or self.micro_batch is None:
            return True
        return self.global_batch % (self.micro_batch * world_size) == 0

    def grad_accum(self, world_size: int) -> int:
        """Micro-batches per step that keep `global_batch` at this world size (1 without a batch split)."""
        if self.global_batch is None or self.micro_batch is None:
            return 1
        return self.global_batch // (self.micro_batch * world_size)


class ClusterConfig(StrictModel):
    cluster: ClusterSettings = ClusterSettings()
    job: JobSettings | None = None

    @model_validator(mode="after")
    def _local_agents_run_their_own_python(self) -> "ClusterConfig":
        """Local agents keep the agent's default allowed_entrypoints, their own interpreter alone: any
        other argv would pass here and then fail every launch (agent/launch_policy.py)."""
        if not self.cluster.local_agents or self.job is None:
            return self
        for key, argv in (("entrypoint", self.job.entrypoint), ("node_check", self.job.node_check or [])):
            if argv and not starts_with_one_of(argv, DEFAULT_ALLOWED_ENTRYPOINTS):
                fix = (f"write {json.dumps(with_python(argv))}" if names_a_python(argv[0]) else
                       f'run a Python script as ["{PYTHON_WORD}", "SCRIPT", ...], or start trainerd-agent on the '
                       f"host yourself with it in the agent file's allowed_entrypoints")
                raise ValueError(f"job.{key}: local agents run only their own interpreter, {PYTHON_WORD} (a python "
                                 f"from PATH is never run): {fix}")
        return self

    # Relative paths in the file (etcd.data_dir, work dirs) are resolved against this.
    base_dir: str = Field(default=".", exclude=True)

    def resolve(self, path: str) -> Path:
        candidate = Path(path)
        return candidate if candidate.is_absolute() else Path(self.base_dir) / candidate


def load_cluster_config(path: str | Path) -> ClusterConfig:
    """Read and validate a cluster file; raises ConfigError with one line naming file and key."""
    path = Path(path)
    data = load_yaml_mapping(path)
    if "base_dir" in data:
        raise ConfigError(f"{path}: base_dir: unknown key")
    data["base_dir"] = str(path.resolve().parent)
    config = validate(ClusterConfig, data, str(path))
    tls = config.cluster.tls
    if tls is not None:
        tls = tls.model_copy(update={key: str(config.resolve(getattr(tls, key)))
                                     for key in ("ca_file", "cert_file", "key_file")})
        config = config.model_copy(update={"cluster": config.cluster.model_copy(update={"tls": tls})})
    join = config.cluster.join
    if join is not None:
        join = join.model_copy(update={"ca_key_file": str(config.resolve(join.ca_key_file))})
        config = config.model_copy(update={"cluster": config.cluster.model_copy(update={"join": join})})
    if config.job is None:
        return config
    # Workers on every node get this path: make it absolute once, here.
    job = config.job
    root = config.resolve(job.checkpoint.dir or f"run/checkpoints/{job.name}").resolve()
    update: dict = {"checkpoint": job.checkpoint.model_copy(update={"dir": str(root)})}
    if job.workdir is not None:
        update["workdir"] = str(config.resolve(job.workdir).resolve())
    elif config.cluster.local_agents:
        # One machine: the job runs where its cluster file is, as msrun runs a script where it is started
        # ("train.py" and its relative data paths are found there). Across hosts each agent's own default.
        update["workdir"] = config.base_dir
    job = job.model_copy(update=update)
    return config.model_copy(update={"job": job})
