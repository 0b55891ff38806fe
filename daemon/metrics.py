"""Prometheus metrics of the coordinator, served on `cluster.coordinator.metrics_listen`."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from prometheus_client import Counter, Gauge, Histogram

HEARTBEATS = Counter("trainerd_heartbeats_total", "Heartbeats received from agents.")
HEARTBEAT_LAG = Histogram(
    "trainerd_heartbeat_lag_seconds",
    "From the agent sending a heartbeat to the coordinator handling it.",
    buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0),
)
ACK_WRITE = Histogram(
    "trainerd_heartbeat_ack_write_seconds",
    "How long writing a heartbeat's ack onto its agent's stream took; the session reads nothing meanwhile.",
    buckets=(0.001, 0.01, 0.1, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0),
)
ACK_WRITES_WAITING = Gauge(
    "trainerd_heartbeat_ack_writes_waiting",
    "Heartbeat acks being written now: each holds its session's reads until the write completes.")
SESSION_END_HEARD = Histogram(
    "trainerd_session_end_heard_seconds",
    "When an agent's session ended (or its new one replaced it): how long before that the coordinator had last "
    "heard from the agent. Short when its heartbeats arrived but it redialed anyway (no ack reached it, or it "
    "gave up waiting for its Welcome); long when it had gone silent first.",
    buckets=(0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0),
)
SESSIONS = Gauge("trainerd_agent_sessions", "Open agent sessions.")
SESSIONS_OPENING = Gauge("trainerd_sessions_opening",
                         "Agent sessions between their Hello and their Welcome; at most "
                         "cluster.coordinator.max_opening_sessions, the rest are told when to come back.")
NODES_LOST = Counter("trainerd_nodes_lost_total", "Nodes declared LOST.")
HELLOS_DEFERRED = Counter("trainerd_hellos_deferred_total",
                          "Hellos deferred (RESOURCE_EXHAUSTED, a retry-after hint): too many waiting to be admitted.")
COORDINATOR_STALL = Counter("trainerd_coordinator_stall_seconds_total",
                            "Seconds the coordinator's event loop ran late; liveness deadlines moved by them.")
PASS_DURATION = Histogram(
    "trainerd_coordinator_pass_seconds",
    "How long each periodic pass of the leader took, its etcd writes included. A stall is measured only "
    "while the leader waits between passes, so a pass that blocks shows here, not in the stall.",
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
)
READ_LAG = Gauge("trainerd_coordinator_read_lag_seconds",
                 "How far behind the leader reads its agents' heartbeats (median, clock offsets removed); "
                 "liveness deadlines allow as much more.")
HEARTBEAT_INTERVAL = Gauge("trainerd_heartbeat_interval_seconds",
                           "The heartbeat interval agents are told now; it stretches (with the timeout) once "
                           "the agents held would send more than heartbeat.max_per_s.")
IS_LEADER = Gauge("trainerd_is_leader", "1 while this coordinator leads.")
NODES = Gauge("trainerd_nodes",
              "Nodes in the records, by state (READY, LOST), set by the leader on every pass. A LOST node stays "
              "until cluster.heartbeat.forget_lost_after_s or until it comes back.", ["state"])
RECOVERY_PHASE = Histogram(
    "trainerd_recovery_phase_seconds",
    "Duration of each phase of a recovery: stop, relaunch, first_step, total.",
    ["phase"],
    buckets=(0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0),
)
RESTARTS = Counter("trainerd_job_restarts_total", "Generations relaunched, by cause.", ["cause"])
PASS_FAILURES = Counter("trainerd_pass_failures_total",
                        "Coordinator passes that failed with an unexpected error (logged, retried).", ["pass"])
AGENT_MESSAGES = Counter("trainerd_agent_messages_total", "Messages received on agent sessions, by kind.", ["kind"])
_AGENT_MESSAGE_COUNTERS: dict[str, Counter] = {}


def agent_message(kind: str) -> Counter:
    """AGENT_MESSAGES' series for `kind`, looked up once (labels() validates and locks on every call, and
    every heartbeat counts)."""
    counter = _AGENT_MESSAGE_COUNTERS.get(kind)
    if counter is None:
        counter = _AGENT_MESSAGE_COUNTERS[kind] = AGENT_MESSAGES.labels(kind)
    return counter


AGENT_MESSAGES_DROPPED = Counter(
    "trainerd_agent_messages_dropped_total",
    "Agent messages dropped: malformed, about a rank not placed on the sending node, or failing.", ["reason"])
# Every reason AGENT_MESSAGES_DROPPED counts, its series at 0 from the start: a rule's increase() sees the
# first drop (a series born at 1 shows no increase).
DROP_REASONS = ("malformed", "failed", "not_placed", "outside_checkpoint_dir", "beyond_progress", "unbound_snapshot")
for _reason in DROP_REASONS:
    AGENT_MESSAGES_DROPPED.labels(_reason)
SESSIONS_REFUSED = Counter("trainerd_sessions_refused_total", "Session streams refused: too many open at once.")

# Per job, labelled `job_name` (a plain `job` label would clash with the scrape job's, which
# Prometheus keeps, renaming ours to exported_job). Set by the leader on every pass; a coordinator
# that stands down removes its series.
JOB_GOODPUT_RATIO = Gauge("trainerd_job_goodput_ratio",
                          "Productive seconds over wall seconds of the job (daemon/job/goodput.py).", ["job_name"])
JOB_PHASE_SECONDS = Gauge(
    "trainerd_job_phase_seconds_total",
    "Seconds of the job's wall time in each phase. A gauge: a fault detected late moves seconds from "
    "productive, lost_work or startup to detection, a reported checkpoint stall from productive or lost_work.",
    ["job_name", "phase"])
JOB_STEP = Gauge("trainerd_job_step", "The newest step a rank of the job's generation reported.", ["job_name"])
JOB_STEP_SECONDS = Gauge("trainerd_job_step_seconds",
                         "Seconds per optimizer step: global_batch over the reported samples/s, else the "
                         "generation's step rate.", ["job_name"])
JOB_LOSS = Gauge("trainerd_job_loss", "The job's loss: the mean over ranks of the last one each reported.",
                 ["job_name"])
JOB_SAMPLES_PER_SECOND = Gauge("trainerd_job_samples_per_second", "Global samples per second the job trains.",
                               ["job_name"])
JOB_STATE = Gauge("trainerd_job_state", "1 for the job's state, 0 for each other state.",
                  ["job_name", "state"])
JOB_RESTART_BUDGET = Gauge("trainerd_job_restart_budget",
                           "Relaunches after crashes the job may spend before it FAILs (job.restart.max).",
                           ["job_name"])
JOB_RESTART_BUDGET_SPENT = Gauge("trainerd_job_restart_budget_spent",
                                 "Relaunches after crashes spent since the job started or was last resumed "
                                 "(membership changes spend none).", ["job_name"])
JOB_CHECKPOINT_STEP = Gauge("trainerd_job_last_checkpoint_step", "The step of the job's newest good checkpoint.",
                            ["job_name"])
JOB_CHECKPOINT_TIME = Gauge("trainerd_job_last_checkpoint_timestamp_seconds",
                            "When the job's newest good checkpoint was committed (Unix seconds); no series while "
                            "that is unknown (no checkpoint yet, or one an older trainerd recorded).",
                            ["job_name"])
JOB_GAUGES = (JOB_GOODPUT_RATIO, JOB_STEP, JOB_STEP_SECONDS, JOB_LOSS, JOB_SAMPLES_PER_SECOND, JOB_RESTART_BUDGET,
              JOB_RESTART_BUDGET_SPENT, JOB_CHECKPOINT_STEP, JOB_CHECKPOINT_TIME)


def set_job_gauge(gauge: Gauge, job: str, value: float | None) -> None:
    """Set the job's series, or remove it while the value is unknown (a gap, not a stale number)."""
    if value is None:
        gauge.remove(job)
    else:
        gauge.labels(job).set(value)


def set_job_state(job: str, state: str, states: Iterable[str]) -> None:
    """One series per state of `states`: 1 for `state`, 0 for the others (a rule can see a state end)."""
    for each in states:
        JOB_STATE.labels(job, each).set(1 if each == state else 0)


def set_nodes(counts: Mapping[str, int]) -> None:
    for state, count in counts.items():
        NODES.labels(state).set(count)


def forget_job(job: str, phases: Iterable[str], states: Iterable[str]) -> None:
    """Remove every series of `job` (this coordinator no longer leads it)."""
    for gauge in JOB_GAUGES:
        gauge.remove(job)
    for phase in phases:
        JOB_PHASE_SECONDS.remove(job, phase)
    for state in states:
        JOB_STATE.remove(job, state)
