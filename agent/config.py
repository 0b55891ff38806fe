"""The agent's config file (`--config agent.yaml`) and the flags that override it."""

from __future__ import annotations

import grp
import hashlib
import json
import os
import pwd
import socket
from pathlib import Path
from typing import Annotated, Any

from pydantic import Field, ValidationInfo, field_validator, model_validator

from common.config_file import Address, ConfigError, StrictModel, load_yaml_mapping, parse_host_port, validate
from common.tls_files import TlsSettings
from proto.vocabulary import DEFAULT_ALLOWED_ENTRYPOINTS, NODE_NAME_PATTERN


class DiscoverySettings(StrictModel):
    """Where Ascend devices are looked for; the defaults are the driver's standard paths."""

    dev_dir: str = "/dev"
    hccn_conf: str = "/etc/hccn.conf"


class RunAsSettings(StrictModel):
    """The user the training processes run as (agent/worker_user.py); the agent itself stays root."""

    user: str = Field(min_length=1)
    # Default: the user's primary group.
    group: str | None = Field(default=None, min_length=1)

    @model_validator(mode="after")
    def _exists_and_can_be_switched_to(self) -> "RunAsSettings":
        try:
            pwd.getpwnam(self.user)
        except KeyError:
            raise ValueError(f"no user {self.user!r} on this host") from None
        if self.group is not None:
            try:
                grp.getgrnam(self.group)
            except KeyError:
                raise ValueError(f"no group {self.group!r} on this host") from None
        if os.geteuid() != 0:
            raise ValueError(f"running the training processes as {self.user} needs the agent to run as root")
        return self


class AgentConfig(StrictModel):
    # One or more coordinator addresses (leader and standbys); the agent finds the leader.
    coordinator: list[Address] = Field(min_length=1)
    node_name: str = Field(default_factory=socket.gethostname, pattern=NODE_NAME_PATTERN)
    # Address the other nodes reach this host at (the MindSpore scheduler may run here). Default: this
    # host's own address on its route to the first coordinator (127.0.0.1 toward a loopback coordinator).
    host: str = Field(default="", validate_default=True)
    @field_validator("host")
    @classmethod
    def _host_toward_the_coordinator(cls, host: str, info: ValidationInfo) -> str:
        """The default host. A loopback address (the default before) put a host the others cannot reach into
        a job spanning hosts, whose ranks then waited for it in MindSpore's cluster set-up for 10 minutes."""
        coordinators = info.data.get("coordinator")
        if host or not coordinators:  # no valid coordinator: that error is told
            return host
        return address_toward(coordinators[0])

    # Hosts without NPUs train on this many CPU "devices" (0: discover NPUs, fail when none).
    cpu_devices: int = Field(default=0, ge=0, le=64)
    work_dir: str = "/var/lib/trainerd-agent"
    # Where the workers' in-memory snapshots go (agent/snapshots/memory_snapshots.py): a directory this agent
    # owns on tmpfs. Default: /dev/shm/trainerd-agent-<12 hex digits of the work dir's path>, so that
    # agents with different work dirs on one host never share it.
    memory_dir: str | None = None
    discovery: DiscoverySettings = DiscoverySettings()
    # The argv prefixes this agent runs, compared word by word with a Launch's argv before "{python}"
    # (the agent's own interpreter) is expanded; a Launch that starts with none is refused. [] runs nothing.
    allowed_entrypoints: list[Annotated[list[str], Field(min_length=1)]] = [
        list(prefix) for prefix in DEFAULT_ALLOWED_ENTRYPOINTS]

    @field_validator("allowed_entrypoints", mode="before")
    @classmethod
    def _prefixes(cls, value: object) -> object:
        """A list of words where a list of prefixes belongs ("{python}" for [["{python}"]]) gets the form to write."""
        if isinstance(value, list) and value and all(isinstance(word, str) for word in value):
            raise ValueError(f"is a list of prefixes, each a list of words: write {json.dumps([value])} for one "
                             f"prefix, or {json.dumps([[word] for word in value])} for each word alone")
        return value
    # The training processes run as this user; none: as the agent's own user (single-machine use).
    run_as: RunAsSettings | None = None
    # The cluster's CA, this node's certificate (`trainerd certs node NAME`) and its key: the agent then
    # talks TLS, trusts only coordinators of that CA, and follows leader hints only to `coordinator`.
    tls: TlsSettings | None = None
    # Fork `{python} -m MODULE` and `{python} SCRIPT` entrypoints from pre-started interpreters that have
    # imported MindSpore once (agent/warm_launcher.py); false: every process starts a new interpreter.
    warm_workers: bool = True
    # MindSpore's compile cache, in a directory per job configuration under work_dir (agent/compile_cache.py).
    # Off unless asked for: MindSpore 2.10 runs a functional training step (value_and_grad and an optimizer
    # call, not a Cell) from its cache with parameters it never set, and the loss is NaN or 1e27 from the
    # first step of every later start. Safe for jobs whose step is a Cell (Model.train, TrainOneStepCell).
    compile_cache: bool = False
    # Serve this host's in-memory snapshot files to the other agents and copy theirs (agent/snapshots/peer_service.py):
    # a generation spanning hosts then snapshots, and a relaunch resumes from what survives on live hosts.
    # Over TLS only with a node certificate that can serve (`trainerd certs node` since peer copies); in
    # plain text only when `host` is a loopback address (nothing listens beyond loopback without TLS).
    snapshot_peers: bool = True
    # The port that service listens on, on `host` (0: one the kernel picks, which a firewall between the
    # hosts must then let through among its ephemeral ports).
    snapshot_peer_port: int = Field(default=0, ge=0, le=65535)


def address_toward(address: str) -> str:
    """This host's own address on its route to `address` (HOST:PORT): the source address the kernel picks
    for a datagram socket connected there (nothing is sent). ValueError when the name does not resolve
    or there is no route."""
    host, port = parse_host_port(address)
    try:
        family, kind, proto, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, kind, proto) as probe:
            probe.connect(sockaddr)
            return str(probe.getsockname()[0])
    except OSError as exc:
        raise ValueError(f"not given, and this host's address toward the coordinator {address} cannot be found "
                         f"({exc.strerror or exc}): set it (--host) to the address other nodes reach this host "
                         f"at") from None


def memory_root(config: AgentConfig) -> Path:
    if config.memory_dir is not None:
        return Path(config.memory_dir)
    digest = hashlib.sha256(os.path.realpath(config.work_dir).encode()).hexdigest()[:12]
    return Path(f"/dev/shm/trainerd-agent-{digest}")


def load_agent_config(path: str | None, overrides: dict[str, Any]) -> AgentConfig:
    """The file (if any) with flag values laid over it; ConfigError names the file or flag."""
    data: dict[str, Any] = load_yaml_mapping(Path(path)) if path else {}
    source = path or "agent flags"
    for key, value in overrides.items():
        if value is not None:
            data[key] = value
    if isinstance(data.get("coordinator"), str):
        data["coordinator"] = [a.strip() for a in data["coordinator"].split(",") if a.strip()]
    if "coordinator" not in data:
        raise ConfigError(f"{source}: coordinator: required (or pass --coordinator HOST:PORT)")
    return validate(AgentConfig, data, source)
