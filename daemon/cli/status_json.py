"""The stable JSON forms of `trainerctl status -o json` and `trainerctl events -o json` (scripts depend on
these names).

A number that is not finite is null: JSON has no NaN or infinity (Python's `json` would
write `NaN`, which jq and most parsers refuse), and a rank reports NaN for a gradient norm it does not know
(a train cell that gives none, a loop that passes none) as well as for a loss or norm that went non-finite.
"""

from __future__ import annotations

import json
import math

from proto import trainerd_pb2 as pb


def _optional(message, field: str):
    return getattr(message, field) if message.HasField(field) else None


def _finite(value):
    """`value` with every float that is not finite replaced by None, in lists and dicts too."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_finite(item) for item in value]
    return value


def status_to_json(reply: pb.StatusReply) -> dict:
    c = reply.coordinator
    return _finite({
        "coordinator": {
            "leader": c.leader_address or None,
            "leader_id": c.leader_id or None,
            "answered_by": c.address,
            "is_leader": c.is_leader,
        },
        "nodes": [
            {
                "name": n.name,
                "host": n.host,
                "state": n.state,
                "devices": [{"device_id": d.device_id, "device_ip": d.device_ip, "kind": d.kind}
                            for d in n.devices],
                "last_heartbeat_age_s": _optional(n, "last_heartbeat_age_s"),
                "drained": n.drained,
                "quarantined": n.quarantined,
                "crashes": n.crashes,
            }
            for n in reply.nodes
        ],
        "job": _job_to_json(reply.job) if reply.HasField("job") else None,
    })


RECOVERY_PHASES = ("stop", "relaunch", "first_step", "total")
# The parts of a recovery's cost, in the order they happen (daemon/job/timeline.py).
COST_PARTS = tuple(field.name for field in pb.RecoveryCost.DESCRIPTOR.fields)


def _recovery_to_json(recovery: pb.RecoveryPhases) -> dict:
    return {"cause": recovery.cause, "resumed_from_step": _optional(recovery, "resumed_from_step"),
            "resumed_from": recovery.resumed_from or None, "lost_steps": _optional(recovery, "lost_steps"),
            **{f"{phase}_s": _optional(recovery, f"{phase}_s") for phase in RECOVERY_PHASES},
            "cost_s": {part: getattr(recovery.cost, part) for part in COST_PARTS}}


# The phases of the job's wall time, in the order status prints them (daemon/job/goodput.py).
GOODPUT_PHASES = ("productive", "lost_work", "detection", "relaunch", "startup", "checkpoint_stall", "waiting",
                  "paused")


def _goodput_to_json(goodput: pb.Goodput) -> dict:
    return {"ratio": goodput.ratio, "wall_s": goodput.wall_s,
            "phases": {f"{phase}_s": getattr(goodput, f"{phase}_s") for phase in GOODPUT_PHASES}}


def _job_to_json(job: pb.JobStatus) -> dict:
    failure = job.last_failure if job.HasField("last_failure") else None
    return {
        "name": job.name,
        "state": job.state,
        "generation": job.generation,
        "world_size": job.world_size,
        "step": _optional(job, "step"),
        "epoch": _optional(job, "epoch"),
        "hang_detection": job.hang_detection,
        "waiting_for": job.waiting_for or None,
        "pausing": job.pausing,
        "warnings": list(job.warnings),
        "spares": list(job.spares),
        "restarts": job.restarts,
        "crash_restarts": job.crash_restarts,
        "restart_budget": job.restart_budget,
        "last_checkpoint_step": _optional(job, "last_checkpoint_step"),
        "skipped_batches": job.skipped_batches,
        "loss": _optional(job, "loss"),
        "grad_norm": _optional(job, "grad_norm"),
        "samples_per_s": _optional(job, "samples_per_s"),
        "ranks": [{"rank": r.rank, "node": r.node, "step": r.step, "epoch": _optional(r, "epoch"), "loss": r.loss,
                   "grad_norm": None if r.from_output else r.grad_norm, "samples_per_s": r.samples_per_s,
                   "from_output": r.from_output} for r in job.ranks],
        "last_failure": None if failure is None else {
            "cause": failure.cause, "node": failure.node or None, "rank": failure.rank,
            "exit_code": failure.exit_code, "signal": failure.signal, "message": failure.message,
            "location": failure.location or None,
        },
        "last_recovery": _recovery_to_json(job.last_recovery) if job.HasField("last_recovery") else None,
        "goodput": _goodput_to_json(job.goodput) if job.HasField("goodput") else None,
    }


def event_to_json(event: pb.Event) -> dict:
    """One line of `trainerctl events -o json`."""
    return {"seq": event.seq, "at": event.at, "kind": event.kind, "message": event.message,
            "fields": json.loads(event.fields_json or "{}")}
