"""Every etcd key trainerd uses, built in one place (docs/concepts/architecture.md)."""

from __future__ import annotations

ROOT = "/trainerd/v1/"

LEADER = ROOT + "leader"
NODES = ROOT + "nodes/"
JOBS = ROOT + "jobs/"
JOIN_TOKENS = ROOT + "join_tokens/"
# Node certificates the coordinator issued (by node name) and those revoked (by serial): daemon/node_authority.py.
NODE_CERTIFICATES = ROOT + "node_certificates/"
REVOKED = ROOT + "revoked_certificates/"


def node(name: str) -> str:
    return NODES + name


def job(job_name: str) -> str:
    return JOBS + job_name + "/"


def job_spec(job_name: str) -> str:
    return job(job_name) + "spec"


def job_status(job_name: str) -> str:
    return job(job_name) + "status"


def generations(job_name: str) -> str:
    return job(job_name) + "generations/"


def generation(job_name: str, number: int) -> str:
    return generations(job_name) + f"{number:010d}"


def checkpoints(job_name: str) -> str:
    return job(job_name) + "checkpoints/"


def checkpoint(job_name: str, step: int) -> str:
    return checkpoints(job_name) + f"{step:012d}"


def skips(job_name: str) -> str:
    return job(job_name) + "skips/"


def skip(job_name: str, skip_id: str) -> str:
    return skips(job_name) + skip_id


def events(job_name: str) -> str:
    return job(job_name) + "events/"


def event(job_name: str, seq: int) -> str:
    return events(job_name) + f"{seq:012d}"


def node_events(job_name: str) -> str:
    """Events about nodes (daemon/events.py NODE_EVENT_KINDS), numbered with the job's events, kept apart."""
    return job(job_name) + "node_events/"


def node_event(job_name: str, seq: int) -> str:
    return node_events(job_name) + f"{seq:012d}"


def job_goodput(job_name: str) -> str:
    return job(job_name) + "goodput"


def join_token(token_id: str) -> str:
    return JOIN_TOKENS + token_id


def node_certificates(name: str) -> str:
    return NODE_CERTIFICATES + name


def revoked(serial: str) -> str:
    return REVOKED + serial
