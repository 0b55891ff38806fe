"""The cluster file (`trainerd start --cluster cluster.yaml`): schema, defaults and validation."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, model_validator

from proto.config_file import Address, ConfigError, StrictModel, load_yaml_mapping, validate


class CoordinatorSettings(StrictModel):
    listen: Address = "127.0.0.1:7420"
    # Where agents and trainerctl reach this coordinator; defaults to `listen`.
    advertise: Address | None = None
    # TTL of the leader lease: a standby takes over at most this long after the leader dies.
    leader_lease_s: int = Field(default=3, ge=2, le=60)
    # Prometheus metrics (HOST:PORT); none when unset.
    metrics_listen: Address | None = None

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
    timeout_s: float = Field(default=5.0, gt=0, le=600)

    @model_validator(mode="after")
    def _timeout_covers_intervals(self) -> "HeartbeatSettings":
        if self.timeout_s < 2 * self.interval_s:
            raise ValueError("timeout_s must be at least twice interval_s")
        return self


class LocalAgentSettings(StrictModel):
    """Agents that `trainerd` itself starts on this host (single-machine mode)."""

    work_dir: str = "run/agents"
    cpu_devices: int = Field(default=1, ge=1, le=64)


class ClusterSettings(StrictModel):
    name: str = Field(default="trainerd", min_length=1, pattern=r"^[A-Za-z0-9_.-]+$")
    coordinator: CoordinatorSettings = CoordinatorSettings()
    etcd: EtcdSettings = EtcdSettings()
    heartbeat: HeartbeatSettings = HeartbeatSettings()
    local_agents: int = Field(default=0, ge=0, le=64)
    local_agent: LocalAgentSettings = LocalAgentSettings()


class JobSettings(StrictModel):
    name: str = Field(default="job", min_length=1, pattern=r"^[A-Za-z0-9_.-]+$")


class ClusterConfig(StrictModel):
    cluster: ClusterSettings = ClusterSettings()
    job: JobSettings | None = None

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
    return validate(ClusterConfig, data, str(path))
