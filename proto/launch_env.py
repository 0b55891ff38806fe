"""The environment variables trainerd hands its processes and reads from its own, each named once here, and
the rules for the variables a job may set.

A training process's environment is a contract between three parties: the coordinator plans it
(`daemon.job.launch_plan`), the agent adds the paths only it knows and checks every Launch
(`agent.supervisor`, `agent.snapshot_keeper`, `agent.launch_policy`), and the worker runtime reads it
(`trainer.runtime.rank_context` and its neighbours). Each constant below says who sets the variable and who
reads it. The operator's variables (the CLI's defaults) and the bench's marker are trainerd's too, so they
are named here as well: every `TRAINERD_*` name has one owner.
"""

from __future__ import annotations

import re

# Every variable trainerd owns begins with this; a job may set none of its own (`forbidden_job_env`).
TRAINERD_ENV_PREFIX = "TRAINERD_"

# --- Set by the coordinator for every process of a generation (daemon.job.launch_plan) ---

# The job's name. Read by the worker runtime (rank_context: set means "launched by trainerd") and by the
# MindFormers launcher (the prefix of its generated YAML).
JOB_ENV = "TRAINERD_JOB"
# The generation number. Read by rank_context and the MindFormers launcher.
GENERATION_ENV = "TRAINERD_GENERATION"
# The process's rank on its host (-1 for the scheduler). Read by rank_context.
LOCAL_RANK_ENV = "TRAINERD_LOCAL_RANK"
# The batch split: global batch, each rank's micro batch and the accumulation steps between them (set only
# when the job spec gives a global batch). Read by rank_context and the examples' defaults.
GLOBAL_BATCH_ENV = "TRAINERD_GLOBAL_BATCH"
MICRO_BATCH_ENV = "TRAINERD_MICRO_BATCH"
GRAD_ACCUM_ENV = "TRAINERD_GRAD_ACCUM"
# The job's checkpoint directory, save interval and retention (`checkpoint:`). Read by rank_context
# (RankCheckpointSettings); KEEP and DIR also by the agent's snapshot keeper when the agent saves.
CHECKPOINT_DIR_ENV = "TRAINERD_CHECKPOINT_DIR"
CHECKPOINT_EVERY_ENV = "TRAINERD_CHECKPOINT_EVERY"
CHECKPOINT_KEEP_ENV = "TRAINERD_CHECKPOINT_KEEP"
# Who writes the disk checkpoints, "worker" or "agent" (`checkpoint.saved_by`). Read by the agent's snapshot
# keeper, which makes an outbox for "agent" (CHECKPOINT_OUTBOX_ENV).
CHECKPOINT_SAVED_BY_ENV = "TRAINERD_CHECKPOINT_SAVED_BY"
# The checkpoint to resume from: a step directory, "" to start fresh; the agent overwrites it with its own
# copy for an in-memory snapshot. Read by rank_context and the MindFormers launcher.
RESUME_FROM_ENV = "TRAINERD_RESUME_FROM"
# The step and consumed samples of that checkpoint. STEP is read by the agent's snapshot keeper, SAMPLES by
# the MindFormers launcher.
RESUME_STEP_ENV = "TRAINERD_RESUME_STEP"
RESUME_SAMPLES_ENV = "TRAINERD_RESUME_SAMPLES"
# The step of the in-memory snapshot the coordinator chose to resume from ("" for none). Read by the agent's
# snapshot keeper (which names the snapshot in RESUME_FROM_ENV) and by rank_context.
RESUME_MEMORY_STEP_ENV = "TRAINERD_RESUME_MEMORY_STEP"
# Snapshot into memory after every N-th step, 0 never, "auto" as often as keeps the stall small; the agent
# sets 0 when it keeps no snapshots. Read by the agent's snapshot keeper and by rank_context.
MEMORY_EVERY_ENV = "TRAINERD_MEMORY_EVERY"
# "host" when the generation spans hosts (each host holds its own ranks' snapshot files), else "". Read by
# the agent's snapshot keeper and by rank_context.
MEMORY_SCOPE_ENV = "TRAINERD_MEMORY_SCOPE"
# The update guard's settings (`data_skip:`). Read by the worker runtime (guard_policy.GuardSettings).
SPIKE_FACTOR_ENV = "TRAINERD_SPIKE_FACTOR"
SPIKE_ZSCORE_ENV = "TRAINERD_SPIKE_ZSCORE"
SPIKE_CEILING_ENV = "TRAINERD_SPIKE_CEILING"
SPIKE_WARMUP_STEPS_ENV = "TRAINERD_SPIKE_WARMUP_STEPS"
LOSS_FACTOR_ENV = "TRAINERD_LOSS_FACTOR"
LOSS_ZSCORE_ENV = "TRAINERD_LOSS_ZSCORE"

# --- Set by the agent, whose paths only it knows (agent.supervisor, agent.snapshot_keeper) ---

# The unix socket the workers send progress datagrams to. Read by trainer.runtime.progress via rank_context.
PROGRESS_SOCKET_ENV = "TRAINERD_PROGRESS_SOCKET"
# The control file (proto.worker_files) through which the agent asks for a checkpoint. Read by rank_context
# and the MindFormers launcher.
CONTROL_FILE_ENV = "TRAINERD_CONTROL_FILE"
# The skips file (proto.worker_files): the skip ledger the generation honours. Read by the worker runtime's
# dataset wrappers and the examples.
SKIPS_FILE_ENV = "TRAINERD_SKIPS_FILE"
# The agent's shared-memory directory for the job's in-memory snapshots. Read by rank_context.
MEMORY_DIR_ENV = "TRAINERD_MEMORY_DIR"
# The outbox the workers write their checkpoint shares into when the agent saves them. Read by rank_context.
CHECKPOINT_OUTBOX_ENV = "TRAINERD_CHECKPOINT_OUTBOX"

# --- Set by an operator, read by trainerd's commands as their options' defaults ---

# trainerctl's --coordinator.
COORDINATOR_ENV = "TRAINERD_COORDINATOR"
# trainerd-agent's --join.
JOIN_TOKEN_ENV = "TRAINERD_JOIN_TOKEN"
# The TLS files of trainerctl and trainerd-agent: --cacert, --cert and --key (common.tls_files).
CACERT_ENV = "TRAINERD_CACERT"
CERT_ENV = "TRAINERD_CERT"
KEY_ENV = "TRAINERD_KEY"

# --- Set and read by bench/launch.py alone ---

# Marks the processes one bench run started, so that it finds (and stops) them and no one else's.
BENCH_LAUNCH_MARKER_ENV = "TRAINERD_BENCH_LAUNCH_MARKER"

# Environment variables of training processes that trainerd sets; a job's `env` may not set them.
# The coordinator sets them all but AGENT_ENV, whose paths only the agent knows.
AGENT_ENV = frozenset({"RANK_TABLE_FILE", PROGRESS_SOCKET_ENV, CONTROL_FILE_ENV, SKIPS_FILE_ENV, MEMORY_DIR_ENV,
                       CHECKPOINT_OUTBOX_ENV})
RESERVED_ENV = AGENT_ENV | frozenset({
    "MS_ROLE", "MS_SCHED_HOST", "MS_SCHED_PORT", "MS_WORKER_NUM", "MS_NODE_ID", "RANK_ID", "RANK_SIZE",
    "DEVICE_ID", JOB_ENV, GENERATION_ENV, LOCAL_RANK_ENV, GLOBAL_BATCH_ENV, MICRO_BATCH_ENV, GRAD_ACCUM_ENV,
    CHECKPOINT_DIR_ENV, CHECKPOINT_EVERY_ENV, CHECKPOINT_KEEP_ENV, CHECKPOINT_SAVED_BY_ENV,
    RESUME_FROM_ENV, RESUME_STEP_ENV, RESUME_SAMPLES_ENV, RESUME_MEMORY_STEP_ENV,
    MEMORY_EVERY_ENV, MEMORY_SCOPE_ENV,
    SPIKE_FACTOR_ENV, SPIKE_ZSCORE_ENV, SPIKE_CEILING_ENV, SPIKE_WARMUP_STEPS_ENV, LOSS_FACTOR_ENV, LOSS_ZSCORE_ENV,
})

# A job's variable names are identifiers: anything else ("A=B", "BASH_FUNC_f%%") is no variable a program
# reads by name, but may be one a shell imports (bash turns BASH_FUNC_name%% into a function it runs).
ENV_NAME_PATTERN = r"[A-Za-z_][A-Za-z0-9_]*"

# Variables that load code or configuration into a process, beside what its argv says: whoever may set them
# runs any code in every training process, so a job's `env` may not (the coordinator refuses the file) and an
# agent refuses a Launch that sets them; the agent's own environment (its service unit) is where such paths
# belong. The dynamic loader's (every LD_*) and glibc's (tunables, charset and locale modules, host aliases);
# a shell's start-up files and options (BASH_ENV and ENV are sourced, PS4 and PROMPT_COMMAND expanded);
# which programs a name runs (PATH: a bash entrypoint's every command); the interpreter's paths, start-up
# file, hooks and warning filters (a filter names a category, which is imported); OpenSSL's configuration
# (it loads engines and providers); the CANN operator packages (custom operators are shared libraries);
# and other runtimes' option variables that name code.
REFUSED_ENV_PREFIXES = ("LD_", "BASH_FUNC_")
REFUSED_ENV = frozenset({
    "GLIBC_TUNABLES", "GCONV_PATH", "LOCPATH", "NLSPATH", "HOSTALIASES", "RESOLV_HOST_CONF",
    "BASH_ENV", "ENV", "SHELLOPTS", "BASHOPTS", "PS4", "PROMPT_COMMAND", "PATH", "CDPATH",
    "PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "PYTHONINSPECT", "PYTHONUSERBASE", "PYTHONPYCACHEPREFIX",
    "PYTHONWARNINGS", "PYTHONBREAKPOINT", "PYTHONEXECUTABLE", "PYTHONPLATLIBDIR",
    "OPENSSL_CONF", "OPENSSL_ENGINES", "OPENSSL_MODULES",
    "ASCEND_CUSTOM_OPP_PATH", "ASCEND_OPP_PATH", "ASCEND_AICPU_PATH", "TBE_IMPL_PATH",
    "NODE_OPTIONS", "PERL5OPT", "PERL5LIB", "RUBYOPT", "RUBYLIB",
})


def forbidden_job_env(name: str) -> str | None:
    """Why a training process may not be given `name` by its job, or None when it may (one line, for the
    coordinator's check of the cluster file and the agent's of a Launch alike)."""
    if not re.fullmatch(ENV_NAME_PATTERN, name):
        return f"a variable's name is a letter or _ then letters, digits and _ ({ENV_NAME_PATTERN})"
    if name.startswith(REFUSED_ENV_PREFIXES) or name in REFUSED_ENV:
        return "it loads code or configuration into the process"
    if name.startswith(TRAINERD_ENV_PREFIX) and name not in RESERVED_ENV:
        return f"{TRAINERD_ENV_PREFIX} names are trainerd's own"
    return None
