from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ProcessState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PROCESS_STATE_UNSPECIFIED: _ClassVar[ProcessState]
    PROCESS_STARTING: _ClassVar[ProcessState]
    PROCESS_RUNNING: _ClassVar[ProcessState]
    PROCESS_EXITED: _ClassVar[ProcessState]

class PeerFileKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PEER_FILE_KIND_UNSPECIFIED: _ClassVar[PeerFileKind]
    PEER_FILE_DATA: _ClassVar[PeerFileKind]
    PEER_FILE_REPORT: _ClassVar[PeerFileKind]
PROCESS_STATE_UNSPECIFIED: ProcessState
PROCESS_STARTING: ProcessState
PROCESS_RUNNING: ProcessState
PROCESS_EXITED: ProcessState
PEER_FILE_KIND_UNSPECIFIED: PeerFileKind
PEER_FILE_DATA: PeerFileKind
PEER_FILE_REPORT: PeerFileKind

class Device(_message.Message):
    __slots__ = ("device_id", "device_ip", "kind")
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_IP_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    device_id: int
    device_ip: str
    kind: str
    def __init__(self, device_id: _Optional[int] = ..., device_ip: _Optional[str] = ..., kind: _Optional[str] = ...) -> None: ...

class Hello(_message.Message):
    __slots__ = ("node_name", "host", "devices", "agent_version", "resume_token", "peer_port", "next_welcome_wait_s")
    NODE_NAME_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    AGENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    RESUME_TOKEN_FIELD_NUMBER: _ClassVar[int]
    PEER_PORT_FIELD_NUMBER: _ClassVar[int]
    NEXT_WELCOME_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    node_name: str
    host: str
    devices: _containers.RepeatedCompositeFieldContainer[Device]
    agent_version: str
    resume_token: str
    peer_port: int
    next_welcome_wait_s: float
    def __init__(self, node_name: _Optional[str] = ..., host: _Optional[str] = ..., devices: _Optional[_Iterable[_Union[Device, _Mapping]]] = ..., agent_version: _Optional[str] = ..., resume_token: _Optional[str] = ..., peer_port: _Optional[int] = ..., next_welcome_wait_s: _Optional[float] = ...) -> None: ...

class ProcessStatus(_message.Message):
    __slots__ = ("role", "rank", "pid", "state", "step", "exit_code", "signal", "expected", "os_state")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    SIGNAL_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_FIELD_NUMBER: _ClassVar[int]
    OS_STATE_FIELD_NUMBER: _ClassVar[int]
    role: str
    rank: int
    pid: int
    state: ProcessState
    step: int
    exit_code: int
    signal: int
    expected: bool
    os_state: str
    def __init__(self, role: _Optional[str] = ..., rank: _Optional[int] = ..., pid: _Optional[int] = ..., state: _Optional[_Union[ProcessState, str]] = ..., step: _Optional[int] = ..., exit_code: _Optional[int] = ..., signal: _Optional[int] = ..., expected: _Optional[bool] = ..., os_state: _Optional[str] = ...) -> None: ...

class Heartbeat(_message.Message):
    __slots__ = ("sequence", "generation", "processes", "sent_at", "memory_snapshot", "held_snapshots")
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    PROCESSES_FIELD_NUMBER: _ClassVar[int]
    SENT_AT_FIELD_NUMBER: _ClassVar[int]
    MEMORY_SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    HELD_SNAPSHOTS_FIELD_NUMBER: _ClassVar[int]
    sequence: int
    generation: int
    processes: _containers.RepeatedCompositeFieldContainer[ProcessStatus]
    sent_at: float
    memory_snapshot: MemorySnapshot
    held_snapshots: _containers.RepeatedCompositeFieldContainer[MemorySnapshot]
    def __init__(self, sequence: _Optional[int] = ..., generation: _Optional[int] = ..., processes: _Optional[_Iterable[_Union[ProcessStatus, _Mapping]]] = ..., sent_at: _Optional[float] = ..., memory_snapshot: _Optional[_Union[MemorySnapshot, _Mapping]] = ..., held_snapshots: _Optional[_Iterable[_Union[MemorySnapshot, _Mapping]]] = ...) -> None: ...

class MemorySnapshot(_message.Message):
    __slots__ = ("step", "consumed_samples", "ranks", "world_size", "generation")
    STEP_FIELD_NUMBER: _ClassVar[int]
    CONSUMED_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    step: int
    consumed_samples: int
    ranks: _containers.RepeatedScalarFieldContainer[int]
    world_size: int
    generation: int
    def __init__(self, step: _Optional[int] = ..., consumed_samples: _Optional[int] = ..., ranks: _Optional[_Iterable[int]] = ..., world_size: _Optional[int] = ..., generation: _Optional[int] = ...) -> None: ...

class ProcessExited(_message.Message):
    __slots__ = ("generation", "role", "rank", "pid", "exit_code", "signal", "log_tail", "expected", "cause")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    SIGNAL_FIELD_NUMBER: _ClassVar[int]
    LOG_TAIL_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_FIELD_NUMBER: _ClassVar[int]
    CAUSE_FIELD_NUMBER: _ClassVar[int]
    generation: int
    role: str
    rank: int
    pid: int
    exit_code: int
    signal: int
    log_tail: str
    expected: bool
    cause: RootCause
    def __init__(self, generation: _Optional[int] = ..., role: _Optional[str] = ..., rank: _Optional[int] = ..., pid: _Optional[int] = ..., exit_code: _Optional[int] = ..., signal: _Optional[int] = ..., log_tail: _Optional[str] = ..., expected: _Optional[bool] = ..., cause: _Optional[_Union[RootCause, _Mapping]] = ...) -> None: ...

class RootCause(_message.Message):
    __slots__ = ("message", "location", "kind")
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    LOCATION_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    message: str
    location: str
    kind: str
    def __init__(self, message: _Optional[str] = ..., location: _Optional[str] = ..., kind: _Optional[str] = ...) -> None: ...

class ProcessStarted(_message.Message):
    __slots__ = ("generation", "role", "rank", "pid")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    generation: int
    role: str
    rank: int
    pid: int
    def __init__(self, generation: _Optional[int] = ..., role: _Optional[str] = ..., rank: _Optional[int] = ..., pid: _Optional[int] = ...) -> None: ...

class Progress(_message.Message):
    __slots__ = ("generation", "rank", "step", "loss", "grad_norm", "samples_per_s", "consumed_samples", "epoch", "from_output", "checkpoint_stall_s", "evaluating", "training_finished", "startup")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    GRAD_NORM_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_PER_S_FIELD_NUMBER: _ClassVar[int]
    CONSUMED_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    FROM_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_STALL_S_FIELD_NUMBER: _ClassVar[int]
    EVALUATING_FIELD_NUMBER: _ClassVar[int]
    TRAINING_FINISHED_FIELD_NUMBER: _ClassVar[int]
    STARTUP_FIELD_NUMBER: _ClassVar[int]
    generation: int
    rank: int
    step: int
    loss: float
    grad_norm: float
    samples_per_s: float
    consumed_samples: int
    epoch: int
    from_output: bool
    checkpoint_stall_s: float
    evaluating: bool
    training_finished: bool
    startup: RankStartup
    def __init__(self, generation: _Optional[int] = ..., rank: _Optional[int] = ..., step: _Optional[int] = ..., loss: _Optional[float] = ..., grad_norm: _Optional[float] = ..., samples_per_s: _Optional[float] = ..., consumed_samples: _Optional[int] = ..., epoch: _Optional[int] = ..., from_output: _Optional[bool] = ..., checkpoint_stall_s: _Optional[float] = ..., evaluating: _Optional[bool] = ..., training_finished: _Optional[bool] = ..., startup: _Optional[_Union[RankStartup, _Mapping]] = ...) -> None: ...

class RankStartup(_message.Message):
    __slots__ = ("comm_setup_s", "load_s", "first_step_s")
    COMM_SETUP_S_FIELD_NUMBER: _ClassVar[int]
    LOAD_S_FIELD_NUMBER: _ClassVar[int]
    FIRST_STEP_S_FIELD_NUMBER: _ClassVar[int]
    comm_setup_s: float
    load_s: float
    first_step_s: float
    def __init__(self, comm_setup_s: _Optional[float] = ..., load_s: _Optional[float] = ..., first_step_s: _Optional[float] = ...) -> None: ...

class BadBatch(_message.Message):
    __slots__ = ("generation", "rank", "step", "sample_start", "sample_end", "reason", "loss", "grad_norm")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_START_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_END_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    GRAD_NORM_FIELD_NUMBER: _ClassVar[int]
    generation: int
    rank: int
    step: int
    sample_start: int
    sample_end: int
    reason: str
    loss: float
    grad_norm: float
    def __init__(self, generation: _Optional[int] = ..., rank: _Optional[int] = ..., step: _Optional[int] = ..., sample_start: _Optional[int] = ..., sample_end: _Optional[int] = ..., reason: _Optional[str] = ..., loss: _Optional[float] = ..., grad_norm: _Optional[float] = ...) -> None: ...

class GuardNotice(_message.Message):
    __slots__ = ("generation", "rank", "step", "notice", "detail")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    NOTICE_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    generation: int
    rank: int
    step: int
    notice: str
    detail: str
    def __init__(self, generation: _Optional[int] = ..., rank: _Optional[int] = ..., step: _Optional[int] = ..., notice: _Optional[str] = ..., detail: _Optional[str] = ...) -> None: ...

class Stopped(_message.Message):
    __slots__ = ("generation", "memory_snapshot", "held_snapshots")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    MEMORY_SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    HELD_SNAPSHOTS_FIELD_NUMBER: _ClassVar[int]
    generation: int
    memory_snapshot: MemorySnapshot
    held_snapshots: _containers.RepeatedCompositeFieldContainer[MemorySnapshot]
    def __init__(self, generation: _Optional[int] = ..., memory_snapshot: _Optional[_Union[MemorySnapshot, _Mapping]] = ..., held_snapshots: _Optional[_Iterable[_Union[MemorySnapshot, _Mapping]]] = ...) -> None: ...

class CheckpointSaved(_message.Message):
    __slots__ = ("generation", "step", "consumed_samples", "path")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    CONSUMED_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    generation: int
    step: int
    consumed_samples: int
    path: str
    def __init__(self, generation: _Optional[int] = ..., step: _Optional[int] = ..., consumed_samples: _Optional[int] = ..., path: _Optional[str] = ...) -> None: ...

class CheckpointFailed(_message.Message):
    __slots__ = ("generation", "rank", "step", "reason")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    generation: int
    rank: int
    step: int
    reason: str
    def __init__(self, generation: _Optional[int] = ..., rank: _Optional[int] = ..., step: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class WorkerWarning(_message.Message):
    __slots__ = ("generation", "rank", "step", "text")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    generation: int
    rank: int
    step: int
    text: str
    def __init__(self, generation: _Optional[int] = ..., rank: _Optional[int] = ..., step: _Optional[int] = ..., text: _Optional[str] = ...) -> None: ...

class AgentMessage(_message.Message):
    __slots__ = ("hello", "heartbeat", "process_started", "process_exited", "progress", "bad_batch", "stopped", "checkpoint_saved", "log_data", "node_check_result", "checkpoint_failed", "guard_notice", "worker_warning", "renew_certificate")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    PROCESS_STARTED_FIELD_NUMBER: _ClassVar[int]
    PROCESS_EXITED_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    BAD_BATCH_FIELD_NUMBER: _ClassVar[int]
    STOPPED_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_SAVED_FIELD_NUMBER: _ClassVar[int]
    LOG_DATA_FIELD_NUMBER: _ClassVar[int]
    NODE_CHECK_RESULT_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_FAILED_FIELD_NUMBER: _ClassVar[int]
    GUARD_NOTICE_FIELD_NUMBER: _ClassVar[int]
    WORKER_WARNING_FIELD_NUMBER: _ClassVar[int]
    RENEW_CERTIFICATE_FIELD_NUMBER: _ClassVar[int]
    hello: Hello
    heartbeat: Heartbeat
    process_started: ProcessStarted
    process_exited: ProcessExited
    progress: Progress
    bad_batch: BadBatch
    stopped: Stopped
    checkpoint_saved: CheckpointSaved
    log_data: LogData
    node_check_result: NodeCheckResult
    checkpoint_failed: CheckpointFailed
    guard_notice: GuardNotice
    worker_warning: WorkerWarning
    renew_certificate: RenewCertificate
    def __init__(self, hello: _Optional[_Union[Hello, _Mapping]] = ..., heartbeat: _Optional[_Union[Heartbeat, _Mapping]] = ..., process_started: _Optional[_Union[ProcessStarted, _Mapping]] = ..., process_exited: _Optional[_Union[ProcessExited, _Mapping]] = ..., progress: _Optional[_Union[Progress, _Mapping]] = ..., bad_batch: _Optional[_Union[BadBatch, _Mapping]] = ..., stopped: _Optional[_Union[Stopped, _Mapping]] = ..., checkpoint_saved: _Optional[_Union[CheckpointSaved, _Mapping]] = ..., log_data: _Optional[_Union[LogData, _Mapping]] = ..., node_check_result: _Optional[_Union[NodeCheckResult, _Mapping]] = ..., checkpoint_failed: _Optional[_Union[CheckpointFailed, _Mapping]] = ..., guard_notice: _Optional[_Union[GuardNotice, _Mapping]] = ..., worker_warning: _Optional[_Union[WorkerWarning, _Mapping]] = ..., renew_certificate: _Optional[_Union[RenewCertificate, _Mapping]] = ...) -> None: ...

class RenewCertificate(_message.Message):
    __slots__ = ("csr_pem",)
    CSR_PEM_FIELD_NUMBER: _ClassVar[int]
    csr_pem: bytes
    def __init__(self, csr_pem: _Optional[bytes] = ...) -> None: ...

class NodeCheckResult(_message.Message):
    __slots__ = ("check_id", "passed", "detail")
    CHECK_ID_FIELD_NUMBER: _ClassVar[int]
    PASSED_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    check_id: int
    passed: bool
    detail: str
    def __init__(self, check_id: _Optional[int] = ..., passed: _Optional[bool] = ..., detail: _Optional[str] = ...) -> None: ...

class LogData(_message.Message):
    __slots__ = ("request_id", "data", "offset", "size", "running", "error")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    data: bytes
    offset: int
    size: int
    running: bool
    error: str
    def __init__(self, request_id: _Optional[int] = ..., data: _Optional[bytes] = ..., offset: _Optional[int] = ..., size: _Optional[int] = ..., running: _Optional[bool] = ..., error: _Optional[str] = ...) -> None: ...

class Welcome(_message.Message):
    __slots__ = ("node_name", "resume_token", "heartbeat_interval_s", "coordinator_id", "heartbeat_timeout_s", "stop_grace_s")
    NODE_NAME_FIELD_NUMBER: _ClassVar[int]
    RESUME_TOKEN_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    COORDINATOR_ID_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    STOP_GRACE_S_FIELD_NUMBER: _ClassVar[int]
    node_name: str
    resume_token: str
    heartbeat_interval_s: float
    coordinator_id: str
    heartbeat_timeout_s: float
    stop_grace_s: float
    def __init__(self, node_name: _Optional[str] = ..., resume_token: _Optional[str] = ..., heartbeat_interval_s: _Optional[float] = ..., coordinator_id: _Optional[str] = ..., heartbeat_timeout_s: _Optional[float] = ..., stop_grace_s: _Optional[float] = ...) -> None: ...

class NodeCheck(_message.Message):
    __slots__ = ("check_id", "argv", "timeout_s")
    CHECK_ID_FIELD_NUMBER: _ClassVar[int]
    ARGV_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    check_id: int
    argv: _containers.RepeatedScalarFieldContainer[str]
    timeout_s: float
    def __init__(self, check_id: _Optional[int] = ..., argv: _Optional[_Iterable[str]] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class HeartbeatAck(_message.Message):
    __slots__ = ("sequence", "interval_s", "timeout_s")
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    sequence: int
    interval_s: float
    timeout_s: float
    def __init__(self, sequence: _Optional[int] = ..., interval_s: _Optional[float] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class ProcessSpec(_message.Message):
    __slots__ = ("role", "rank", "local_rank", "device_id", "argv", "env")
    class EnvEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ROLE_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    LOCAL_RANK_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    ARGV_FIELD_NUMBER: _ClassVar[int]
    ENV_FIELD_NUMBER: _ClassVar[int]
    role: str
    rank: int
    local_rank: int
    device_id: int
    argv: _containers.RepeatedScalarFieldContainer[str]
    env: _containers.ScalarMap[str, str]
    def __init__(self, role: _Optional[str] = ..., rank: _Optional[int] = ..., local_rank: _Optional[int] = ..., device_id: _Optional[int] = ..., argv: _Optional[_Iterable[str]] = ..., env: _Optional[_Mapping[str, str]] = ...) -> None: ...

class SampleRange(_message.Message):
    __slots__ = ("start", "end")
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    start: int
    end: int
    def __init__(self, start: _Optional[int] = ..., end: _Optional[int] = ...) -> None: ...

class Launch(_message.Message):
    __slots__ = ("generation", "job_name", "processes", "rank_table_json", "checkpoint_path", "skips", "workdir", "graceful_exit_file", "progress_pattern", "snapshot_sources", "copy_from", "peer_nodes")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    JOB_NAME_FIELD_NUMBER: _ClassVar[int]
    PROCESSES_FIELD_NUMBER: _ClassVar[int]
    RANK_TABLE_JSON_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_PATH_FIELD_NUMBER: _ClassVar[int]
    SKIPS_FIELD_NUMBER: _ClassVar[int]
    WORKDIR_FIELD_NUMBER: _ClassVar[int]
    GRACEFUL_EXIT_FILE_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_PATTERN_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_SOURCES_FIELD_NUMBER: _ClassVar[int]
    COPY_FROM_FIELD_NUMBER: _ClassVar[int]
    PEER_NODES_FIELD_NUMBER: _ClassVar[int]
    generation: int
    job_name: str
    processes: _containers.RepeatedCompositeFieldContainer[ProcessSpec]
    rank_table_json: str
    checkpoint_path: str
    skips: _containers.RepeatedCompositeFieldContainer[SampleRange]
    workdir: str
    graceful_exit_file: str
    progress_pattern: str
    snapshot_sources: _containers.RepeatedCompositeFieldContainer[SnapshotSource]
    copy_from: PeerAgent
    peer_nodes: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, generation: _Optional[int] = ..., job_name: _Optional[str] = ..., processes: _Optional[_Iterable[_Union[ProcessSpec, _Mapping]]] = ..., rank_table_json: _Optional[str] = ..., checkpoint_path: _Optional[str] = ..., skips: _Optional[_Iterable[_Union[SampleRange, _Mapping]]] = ..., workdir: _Optional[str] = ..., graceful_exit_file: _Optional[str] = ..., progress_pattern: _Optional[str] = ..., snapshot_sources: _Optional[_Iterable[_Union[SnapshotSource, _Mapping]]] = ..., copy_from: _Optional[_Union[PeerAgent, _Mapping]] = ..., peer_nodes: _Optional[_Iterable[str]] = ...) -> None: ...

class Standby(_message.Message):
    __slots__ = ("generation", "job_name", "processes", "workdir")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    JOB_NAME_FIELD_NUMBER: _ClassVar[int]
    PROCESSES_FIELD_NUMBER: _ClassVar[int]
    WORKDIR_FIELD_NUMBER: _ClassVar[int]
    generation: int
    job_name: str
    processes: _containers.RepeatedCompositeFieldContainer[ProcessSpec]
    workdir: str
    def __init__(self, generation: _Optional[int] = ..., job_name: _Optional[str] = ..., processes: _Optional[_Iterable[_Union[ProcessSpec, _Mapping]]] = ..., workdir: _Optional[str] = ...) -> None: ...

class PeerAgent(_message.Message):
    __slots__ = ("node", "address")
    NODE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    node: str
    address: str
    def __init__(self, node: _Optional[str] = ..., address: _Optional[str] = ...) -> None: ...

class SnapshotSource(_message.Message):
    __slots__ = ("rank", "holder")
    RANK_FIELD_NUMBER: _ClassVar[int]
    HOLDER_FIELD_NUMBER: _ClassVar[int]
    rank: int
    holder: PeerAgent
    def __init__(self, rank: _Optional[int] = ..., holder: _Optional[_Union[PeerAgent, _Mapping]] = ...) -> None: ...

class Stop(_message.Message):
    __slots__ = ("generation", "grace_s", "reason", "dump_stacks", "job_completed")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    GRACE_S_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    DUMP_STACKS_FIELD_NUMBER: _ClassVar[int]
    JOB_COMPLETED_FIELD_NUMBER: _ClassVar[int]
    generation: int
    grace_s: float
    reason: str
    dump_stacks: bool
    job_completed: bool
    def __init__(self, generation: _Optional[int] = ..., grace_s: _Optional[float] = ..., reason: _Optional[str] = ..., dump_stacks: _Optional[bool] = ..., job_completed: _Optional[bool] = ...) -> None: ...

class RequestExit(_message.Message):
    __slots__ = ("generation",)
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    generation: int
    def __init__(self, generation: _Optional[int] = ...) -> None: ...

class ReadLog(_message.Message):
    __slots__ = ("request_id", "generation", "role", "rank", "offset", "max_bytes")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    MAX_BYTES_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    generation: int
    role: str
    rank: int
    offset: int
    max_bytes: int
    def __init__(self, request_id: _Optional[int] = ..., generation: _Optional[int] = ..., role: _Optional[str] = ..., rank: _Optional[int] = ..., offset: _Optional[int] = ..., max_bytes: _Optional[int] = ...) -> None: ...

class CheckpointNow(_message.Message):
    __slots__ = ("generation", "step")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    generation: int
    step: int
    def __init__(self, generation: _Optional[int] = ..., step: _Optional[int] = ...) -> None: ...

class CoordinatorMessage(_message.Message):
    __slots__ = ("welcome", "launch", "stop", "checkpoint_now", "request_exit", "read_log", "heartbeat_ack", "node_check", "revocations", "node_certificate", "standby")
    WELCOME_FIELD_NUMBER: _ClassVar[int]
    LAUNCH_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_NOW_FIELD_NUMBER: _ClassVar[int]
    REQUEST_EXIT_FIELD_NUMBER: _ClassVar[int]
    READ_LOG_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_ACK_FIELD_NUMBER: _ClassVar[int]
    NODE_CHECK_FIELD_NUMBER: _ClassVar[int]
    REVOCATIONS_FIELD_NUMBER: _ClassVar[int]
    NODE_CERTIFICATE_FIELD_NUMBER: _ClassVar[int]
    STANDBY_FIELD_NUMBER: _ClassVar[int]
    welcome: Welcome
    launch: Launch
    stop: Stop
    checkpoint_now: CheckpointNow
    request_exit: RequestExit
    read_log: ReadLog
    heartbeat_ack: HeartbeatAck
    node_check: NodeCheck
    revocations: Revocations
    node_certificate: NodeCertificate
    standby: Standby
    def __init__(self, welcome: _Optional[_Union[Welcome, _Mapping]] = ..., launch: _Optional[_Union[Launch, _Mapping]] = ..., stop: _Optional[_Union[Stop, _Mapping]] = ..., checkpoint_now: _Optional[_Union[CheckpointNow, _Mapping]] = ..., request_exit: _Optional[_Union[RequestExit, _Mapping]] = ..., read_log: _Optional[_Union[ReadLog, _Mapping]] = ..., heartbeat_ack: _Optional[_Union[HeartbeatAck, _Mapping]] = ..., node_check: _Optional[_Union[NodeCheck, _Mapping]] = ..., revocations: _Optional[_Union[Revocations, _Mapping]] = ..., node_certificate: _Optional[_Union[NodeCertificate, _Mapping]] = ..., standby: _Optional[_Union[Standby, _Mapping]] = ...) -> None: ...

class Revocations(_message.Message):
    __slots__ = ("serials",)
    SERIALS_FIELD_NUMBER: _ClassVar[int]
    serials: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, serials: _Optional[_Iterable[str]] = ...) -> None: ...

class NodeCertificate(_message.Message):
    __slots__ = ("certificate_pem",)
    CERTIFICATE_PEM_FIELD_NUMBER: _ClassVar[int]
    certificate_pem: bytes
    def __init__(self, certificate_pem: _Optional[bytes] = ...) -> None: ...

class CreateTokenRequest(_message.Message):
    __slots__ = ("ttl_s", "uses")
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    USES_FIELD_NUMBER: _ClassVar[int]
    ttl_s: float
    uses: int
    def __init__(self, ttl_s: _Optional[float] = ..., uses: _Optional[int] = ...) -> None: ...

class CreateTokenReply(_message.Message):
    __slots__ = ("token", "expires_at", "ca_pin", "join_address", "coordinators")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    CA_PIN_FIELD_NUMBER: _ClassVar[int]
    JOIN_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    COORDINATORS_FIELD_NUMBER: _ClassVar[int]
    token: str
    expires_at: float
    ca_pin: str
    join_address: str
    coordinators: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, token: _Optional[str] = ..., expires_at: _Optional[float] = ..., ca_pin: _Optional[str] = ..., join_address: _Optional[str] = ..., coordinators: _Optional[_Iterable[str]] = ...) -> None: ...

class ListTokensRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TokenInfo(_message.Message):
    __slots__ = ("id", "created_at", "expires_at", "uses_left")
    ID_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    USES_LEFT_FIELD_NUMBER: _ClassVar[int]
    id: str
    created_at: float
    expires_at: float
    uses_left: int
    def __init__(self, id: _Optional[str] = ..., created_at: _Optional[float] = ..., expires_at: _Optional[float] = ..., uses_left: _Optional[int] = ...) -> None: ...

class ListTokensReply(_message.Message):
    __slots__ = ("tokens",)
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedCompositeFieldContainer[TokenInfo]
    def __init__(self, tokens: _Optional[_Iterable[_Union[TokenInfo, _Mapping]]] = ...) -> None: ...

class DeleteTokenRequest(_message.Message):
    __slots__ = ("id",)
    ID_FIELD_NUMBER: _ClassVar[int]
    id: str
    def __init__(self, id: _Optional[str] = ...) -> None: ...

class RevokeNodeRequest(_message.Message):
    __slots__ = ("node",)
    NODE_FIELD_NUMBER: _ClassVar[int]
    node: str
    def __init__(self, node: _Optional[str] = ...) -> None: ...

class AuthorityRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AuthorityReply(_message.Message):
    __slots__ = ("ca_pem",)
    CA_PEM_FIELD_NUMBER: _ClassVar[int]
    ca_pem: bytes
    def __init__(self, ca_pem: _Optional[bytes] = ...) -> None: ...

class JoinRequest(_message.Message):
    __slots__ = ("token", "node_name", "csr_pem")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    NODE_NAME_FIELD_NUMBER: _ClassVar[int]
    CSR_PEM_FIELD_NUMBER: _ClassVar[int]
    token: str
    node_name: str
    csr_pem: bytes
    def __init__(self, token: _Optional[str] = ..., node_name: _Optional[str] = ..., csr_pem: _Optional[bytes] = ...) -> None: ...

class JoinReply(_message.Message):
    __slots__ = ("certificate_pem",)
    CERTIFICATE_PEM_FIELD_NUMBER: _ClassVar[int]
    certificate_pem: bytes
    def __init__(self, certificate_pem: _Optional[bytes] = ...) -> None: ...

class LogRequest(_message.Message):
    __slots__ = ("rank", "generation", "offset", "max_bytes")
    RANK_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    MAX_BYTES_FIELD_NUMBER: _ClassVar[int]
    rank: int
    generation: int
    offset: int
    max_bytes: int
    def __init__(self, rank: _Optional[int] = ..., generation: _Optional[int] = ..., offset: _Optional[int] = ..., max_bytes: _Optional[int] = ...) -> None: ...

class LogReply(_message.Message):
    __slots__ = ("data", "offset", "size", "running", "generation", "node")
    DATA_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    offset: int
    size: int
    running: bool
    generation: int
    node: str
    def __init__(self, data: _Optional[bytes] = ..., offset: _Optional[int] = ..., size: _Optional[int] = ..., running: _Optional[bool] = ..., generation: _Optional[int] = ..., node: _Optional[str] = ...) -> None: ...

class CommandReply(_message.Message):
    __slots__ = ("message",)
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    message: str
    def __init__(self, message: _Optional[str] = ...) -> None: ...

class PauseRequest(_message.Message):
    __slots__ = ("now",)
    NOW_FIELD_NUMBER: _ClassVar[int]
    now: bool
    def __init__(self, now: _Optional[bool] = ...) -> None: ...

class ResumeRequest(_message.Message):
    __slots__ = ("from_step",)
    FROM_STEP_FIELD_NUMBER: _ClassVar[int]
    from_step: int
    def __init__(self, from_step: _Optional[int] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("node", "drained")
    NODE_FIELD_NUMBER: _ClassVar[int]
    DRAINED_FIELD_NUMBER: _ClassVar[int]
    node: str
    drained: bool
    def __init__(self, node: _Optional[str] = ..., drained: _Optional[bool] = ...) -> None: ...

class SkipsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SkipEntry(_message.Message):
    __slots__ = ("start", "end", "reason", "step", "generation", "id")
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    start: int
    end: int
    reason: str
    step: int
    generation: int
    id: str
    def __init__(self, start: _Optional[int] = ..., end: _Optional[int] = ..., reason: _Optional[str] = ..., step: _Optional[int] = ..., generation: _Optional[int] = ..., id: _Optional[str] = ...) -> None: ...

class SkipsReply(_message.Message):
    __slots__ = ("skips",)
    SKIPS_FIELD_NUMBER: _ClassVar[int]
    skips: _containers.RepeatedCompositeFieldContainer[SkipEntry]
    def __init__(self, skips: _Optional[_Iterable[_Union[SkipEntry, _Mapping]]] = ...) -> None: ...

class AddSkipRequest(_message.Message):
    __slots__ = ("start", "end", "reason")
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    start: int
    end: int
    reason: str
    def __init__(self, start: _Optional[int] = ..., end: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class EventsRequest(_message.Message):
    __slots__ = ("after_seq", "limit")
    AFTER_SEQ_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    after_seq: int
    limit: int
    def __init__(self, after_seq: _Optional[int] = ..., limit: _Optional[int] = ...) -> None: ...

class Event(_message.Message):
    __slots__ = ("seq", "at", "kind", "message", "fields_json")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    AT_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    FIELDS_JSON_FIELD_NUMBER: _ClassVar[int]
    seq: int
    at: float
    kind: str
    message: str
    fields_json: str
    def __init__(self, seq: _Optional[int] = ..., at: _Optional[float] = ..., kind: _Optional[str] = ..., message: _Optional[str] = ..., fields_json: _Optional[str] = ...) -> None: ...

class EventsReply(_message.Message):
    __slots__ = ("events",)
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[Event]
    def __init__(self, events: _Optional[_Iterable[_Union[Event, _Mapping]]] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CoordinatorInfo(_message.Message):
    __slots__ = ("id", "address", "is_leader", "leader_id", "leader_address")
    ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    IS_LEADER_FIELD_NUMBER: _ClassVar[int]
    LEADER_ID_FIELD_NUMBER: _ClassVar[int]
    LEADER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    id: str
    address: str
    is_leader: bool
    leader_id: str
    leader_address: str
    def __init__(self, id: _Optional[str] = ..., address: _Optional[str] = ..., is_leader: _Optional[bool] = ..., leader_id: _Optional[str] = ..., leader_address: _Optional[str] = ...) -> None: ...

class NodeStatus(_message.Message):
    __slots__ = ("name", "host", "state", "devices", "last_heartbeat_age_s", "drained", "quarantined", "crashes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    LAST_HEARTBEAT_AGE_S_FIELD_NUMBER: _ClassVar[int]
    DRAINED_FIELD_NUMBER: _ClassVar[int]
    QUARANTINED_FIELD_NUMBER: _ClassVar[int]
    CRASHES_FIELD_NUMBER: _ClassVar[int]
    name: str
    host: str
    state: str
    devices: _containers.RepeatedCompositeFieldContainer[Device]
    last_heartbeat_age_s: float
    drained: bool
    quarantined: bool
    crashes: int
    def __init__(self, name: _Optional[str] = ..., host: _Optional[str] = ..., state: _Optional[str] = ..., devices: _Optional[_Iterable[_Union[Device, _Mapping]]] = ..., last_heartbeat_age_s: _Optional[float] = ..., drained: _Optional[bool] = ..., quarantined: _Optional[bool] = ..., crashes: _Optional[int] = ...) -> None: ...

class RankStatus(_message.Message):
    __slots__ = ("rank", "node", "step", "loss", "samples_per_s", "epoch", "from_output", "grad_norm")
    RANK_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_PER_S_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    FROM_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    GRAD_NORM_FIELD_NUMBER: _ClassVar[int]
    rank: int
    node: str
    step: int
    loss: float
    samples_per_s: float
    epoch: int
    from_output: bool
    grad_norm: float
    def __init__(self, rank: _Optional[int] = ..., node: _Optional[str] = ..., step: _Optional[int] = ..., loss: _Optional[float] = ..., samples_per_s: _Optional[float] = ..., epoch: _Optional[int] = ..., from_output: _Optional[bool] = ..., grad_norm: _Optional[float] = ...) -> None: ...

class Failure(_message.Message):
    __slots__ = ("cause", "node", "rank", "exit_code", "signal", "message", "location")
    CAUSE_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    SIGNAL_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    LOCATION_FIELD_NUMBER: _ClassVar[int]
    cause: str
    node: str
    rank: int
    exit_code: int
    signal: int
    message: str
    location: str
    def __init__(self, cause: _Optional[str] = ..., node: _Optional[str] = ..., rank: _Optional[int] = ..., exit_code: _Optional[int] = ..., signal: _Optional[int] = ..., message: _Optional[str] = ..., location: _Optional[str] = ...) -> None: ...

class RecoveryPhases(_message.Message):
    __slots__ = ("cause", "stop_s", "relaunch_s", "first_step_s", "total_s", "resumed_from_step", "resumed_from", "lost_steps", "cost")
    CAUSE_FIELD_NUMBER: _ClassVar[int]
    STOP_S_FIELD_NUMBER: _ClassVar[int]
    RELAUNCH_S_FIELD_NUMBER: _ClassVar[int]
    FIRST_STEP_S_FIELD_NUMBER: _ClassVar[int]
    TOTAL_S_FIELD_NUMBER: _ClassVar[int]
    RESUMED_FROM_STEP_FIELD_NUMBER: _ClassVar[int]
    RESUMED_FROM_FIELD_NUMBER: _ClassVar[int]
    LOST_STEPS_FIELD_NUMBER: _ClassVar[int]
    COST_FIELD_NUMBER: _ClassVar[int]
    cause: str
    stop_s: float
    relaunch_s: float
    first_step_s: float
    total_s: float
    resumed_from_step: int
    resumed_from: str
    lost_steps: int
    cost: RecoveryCost
    def __init__(self, cause: _Optional[str] = ..., stop_s: _Optional[float] = ..., relaunch_s: _Optional[float] = ..., first_step_s: _Optional[float] = ..., total_s: _Optional[float] = ..., resumed_from_step: _Optional[int] = ..., resumed_from: _Optional[str] = ..., lost_steps: _Optional[int] = ..., cost: _Optional[_Union[RecoveryCost, _Mapping]] = ...) -> None: ...

class RecoveryCost(_message.Message):
    __slots__ = ("detect", "stop", "relaunch", "comm_setup", "compile", "load", "lost_work")
    DETECT_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    RELAUNCH_FIELD_NUMBER: _ClassVar[int]
    COMM_SETUP_FIELD_NUMBER: _ClassVar[int]
    COMPILE_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    LOST_WORK_FIELD_NUMBER: _ClassVar[int]
    detect: float
    stop: float
    relaunch: float
    comm_setup: float
    compile: float
    load: float
    lost_work: float
    def __init__(self, detect: _Optional[float] = ..., stop: _Optional[float] = ..., relaunch: _Optional[float] = ..., comm_setup: _Optional[float] = ..., compile: _Optional[float] = ..., load: _Optional[float] = ..., lost_work: _Optional[float] = ...) -> None: ...

class Goodput(_message.Message):
    __slots__ = ("ratio", "wall_s", "productive_s", "lost_work_s", "detection_s", "relaunch_s", "startup_s", "checkpoint_stall_s", "waiting_s", "paused_s")
    RATIO_FIELD_NUMBER: _ClassVar[int]
    WALL_S_FIELD_NUMBER: _ClassVar[int]
    PRODUCTIVE_S_FIELD_NUMBER: _ClassVar[int]
    LOST_WORK_S_FIELD_NUMBER: _ClassVar[int]
    DETECTION_S_FIELD_NUMBER: _ClassVar[int]
    RELAUNCH_S_FIELD_NUMBER: _ClassVar[int]
    STARTUP_S_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_STALL_S_FIELD_NUMBER: _ClassVar[int]
    WAITING_S_FIELD_NUMBER: _ClassVar[int]
    PAUSED_S_FIELD_NUMBER: _ClassVar[int]
    ratio: float
    wall_s: float
    productive_s: float
    lost_work_s: float
    detection_s: float
    relaunch_s: float
    startup_s: float
    checkpoint_stall_s: float
    waiting_s: float
    paused_s: float
    def __init__(self, ratio: _Optional[float] = ..., wall_s: _Optional[float] = ..., productive_s: _Optional[float] = ..., lost_work_s: _Optional[float] = ..., detection_s: _Optional[float] = ..., relaunch_s: _Optional[float] = ..., startup_s: _Optional[float] = ..., checkpoint_stall_s: _Optional[float] = ..., waiting_s: _Optional[float] = ..., paused_s: _Optional[float] = ...) -> None: ...

class JobStatus(_message.Message):
    __slots__ = ("name", "state", "generation", "world_size", "step", "restarts", "last_checkpoint_step", "skipped_batches", "loss", "samples_per_s", "ranks", "last_failure", "crash_restarts", "restart_budget", "last_recovery", "waiting_for", "epoch", "hang_detection", "goodput", "grad_norm", "pausing", "warnings", "spares")
    NAME_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    RESTARTS_FIELD_NUMBER: _ClassVar[int]
    LAST_CHECKPOINT_STEP_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_BATCHES_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_PER_S_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    LAST_FAILURE_FIELD_NUMBER: _ClassVar[int]
    CRASH_RESTARTS_FIELD_NUMBER: _ClassVar[int]
    RESTART_BUDGET_FIELD_NUMBER: _ClassVar[int]
    LAST_RECOVERY_FIELD_NUMBER: _ClassVar[int]
    WAITING_FOR_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    HANG_DETECTION_FIELD_NUMBER: _ClassVar[int]
    GOODPUT_FIELD_NUMBER: _ClassVar[int]
    GRAD_NORM_FIELD_NUMBER: _ClassVar[int]
    PAUSING_FIELD_NUMBER: _ClassVar[int]
    WARNINGS_FIELD_NUMBER: _ClassVar[int]
    SPARES_FIELD_NUMBER: _ClassVar[int]
    name: str
    state: str
    generation: int
    world_size: int
    step: int
    restarts: int
    last_checkpoint_step: int
    skipped_batches: int
    loss: float
    samples_per_s: float
    ranks: _containers.RepeatedCompositeFieldContainer[RankStatus]
    last_failure: Failure
    crash_restarts: int
    restart_budget: int
    last_recovery: RecoveryPhases
    waiting_for: str
    epoch: int
    hang_detection: bool
    goodput: Goodput
    grad_norm: float
    pausing: bool
    warnings: _containers.RepeatedScalarFieldContainer[str]
    spares: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, name: _Optional[str] = ..., state: _Optional[str] = ..., generation: _Optional[int] = ..., world_size: _Optional[int] = ..., step: _Optional[int] = ..., restarts: _Optional[int] = ..., last_checkpoint_step: _Optional[int] = ..., skipped_batches: _Optional[int] = ..., loss: _Optional[float] = ..., samples_per_s: _Optional[float] = ..., ranks: _Optional[_Iterable[_Union[RankStatus, _Mapping]]] = ..., last_failure: _Optional[_Union[Failure, _Mapping]] = ..., crash_restarts: _Optional[int] = ..., restart_budget: _Optional[int] = ..., last_recovery: _Optional[_Union[RecoveryPhases, _Mapping]] = ..., waiting_for: _Optional[str] = ..., epoch: _Optional[int] = ..., hang_detection: _Optional[bool] = ..., goodput: _Optional[_Union[Goodput, _Mapping]] = ..., grad_norm: _Optional[float] = ..., pausing: _Optional[bool] = ..., warnings: _Optional[_Iterable[str]] = ..., spares: _Optional[_Iterable[str]] = ...) -> None: ...

class StatusReply(_message.Message):
    __slots__ = ("coordinator", "nodes", "job")
    COORDINATOR_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    coordinator: CoordinatorInfo
    nodes: _containers.RepeatedCompositeFieldContainer[NodeStatus]
    job: JobStatus
    def __init__(self, coordinator: _Optional[_Union[CoordinatorInfo, _Mapping]] = ..., nodes: _Optional[_Iterable[_Union[NodeStatus, _Mapping]]] = ..., job: _Optional[_Union[JobStatus, _Mapping]] = ...) -> None: ...

class PeerListRequest(_message.Message):
    __slots__ = ("job_name", "newer_than_step", "wait_s")
    JOB_NAME_FIELD_NUMBER: _ClassVar[int]
    NEWER_THAN_STEP_FIELD_NUMBER: _ClassVar[int]
    WAIT_S_FIELD_NUMBER: _ClassVar[int]
    job_name: str
    newer_than_step: int
    wait_s: float
    def __init__(self, job_name: _Optional[str] = ..., newer_than_step: _Optional[int] = ..., wait_s: _Optional[float] = ...) -> None: ...

class PeerListReply(_message.Message):
    __slots__ = ("own",)
    OWN_FIELD_NUMBER: _ClassVar[int]
    own: _containers.RepeatedCompositeFieldContainer[MemorySnapshot]
    def __init__(self, own: _Optional[_Iterable[_Union[MemorySnapshot, _Mapping]]] = ...) -> None: ...

class PeerFetchRequest(_message.Message):
    __slots__ = ("job_name", "step", "rank", "kind")
    JOB_NAME_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    job_name: str
    step: int
    rank: int
    kind: PeerFileKind
    def __init__(self, job_name: _Optional[str] = ..., step: _Optional[int] = ..., rank: _Optional[int] = ..., kind: _Optional[_Union[PeerFileKind, str]] = ...) -> None: ...

class PeerChunk(_message.Message):
    __slots__ = ("data",)
    DATA_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    def __init__(self, data: _Optional[bytes] = ...) -> None: ...
