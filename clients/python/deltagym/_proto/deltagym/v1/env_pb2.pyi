import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class VerifierMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    VERIFIER_MODE_UNSPECIFIED: _ClassVar[VerifierMode]
    VERIFIER_MODE_SANDBOX: _ClassVar[VerifierMode]
    VERIFIER_MODE_PRISTINE: _ClassVar[VerifierMode]

class ProcessMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PROCESS_MODE_UNSPECIFIED: _ClassVar[ProcessMode]
    PROCESS_MODE_FILESYSTEM: _ClassVar[ProcessMode]
    PROCESS_MODE_TEMPLATE: _ClassVar[ProcessMode]
    PROCESS_MODE_CRIU: _ClassVar[ProcessMode]

class CaptureMethod(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CAPTURE_METHOD_UNSPECIFIED: _ClassVar[CaptureMethod]
    CAPTURE_METHOD_NONE: _ClassVar[CaptureMethod]
    CAPTURE_METHOD_TEMPLATE: _ClassVar[CaptureMethod]
    CAPTURE_METHOD_CRIU: _ClassVar[CaptureMethod]

class SandboxState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SANDBOX_STATE_UNSPECIFIED: _ClassVar[SandboxState]
    SANDBOX_STATE_READY: _ClassVar[SandboxState]
    SANDBOX_STATE_DONE: _ClassVar[SandboxState]
    SANDBOX_STATE_CLOSED: _ClassVar[SandboxState]
VERIFIER_MODE_UNSPECIFIED: VerifierMode
VERIFIER_MODE_SANDBOX: VerifierMode
VERIFIER_MODE_PRISTINE: VerifierMode
PROCESS_MODE_UNSPECIFIED: ProcessMode
PROCESS_MODE_FILESYSTEM: ProcessMode
PROCESS_MODE_TEMPLATE: ProcessMode
PROCESS_MODE_CRIU: ProcessMode
CAPTURE_METHOD_UNSPECIFIED: CaptureMethod
CAPTURE_METHOD_NONE: CaptureMethod
CAPTURE_METHOD_TEMPLATE: CaptureMethod
CAPTURE_METHOD_CRIU: CaptureMethod
SANDBOX_STATE_UNSPECIFIED: SandboxState
SANDBOX_STATE_READY: SandboxState
SANDBOX_STATE_DONE: SandboxState
SANDBOX_STATE_CLOSED: SandboxState

class EnvSpec(_message.Message):
    __slots__ = ("name", "description", "image", "task", "setup", "reset_hook", "verifier", "env", "workdir", "limits", "budgets", "pool_size", "process_mode", "evaluation", "egress")
    class EnvEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    SETUP_FIELD_NUMBER: _ClassVar[int]
    RESET_HOOK_FIELD_NUMBER: _ClassVar[int]
    VERIFIER_FIELD_NUMBER: _ClassVar[int]
    ENV_FIELD_NUMBER: _ClassVar[int]
    WORKDIR_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    BUDGETS_FIELD_NUMBER: _ClassVar[int]
    POOL_SIZE_FIELD_NUMBER: _ClassVar[int]
    PROCESS_MODE_FIELD_NUMBER: _ClassVar[int]
    EVALUATION_FIELD_NUMBER: _ClassVar[int]
    EGRESS_FIELD_NUMBER: _ClassVar[int]
    name: str
    description: str
    image: str
    task: str
    setup: _containers.RepeatedScalarFieldContainer[str]
    reset_hook: str
    verifier: str
    env: _containers.ScalarMap[str, str]
    workdir: str
    limits: Limits
    budgets: Budgets
    pool_size: int
    process_mode: ProcessMode
    evaluation: Evaluation
    egress: Egress
    def __init__(self, name: _Optional[str] = ..., description: _Optional[str] = ..., image: _Optional[str] = ..., task: _Optional[str] = ..., setup: _Optional[_Iterable[str]] = ..., reset_hook: _Optional[str] = ..., verifier: _Optional[str] = ..., env: _Optional[_Mapping[str, str]] = ..., workdir: _Optional[str] = ..., limits: _Optional[_Union[Limits, _Mapping]] = ..., budgets: _Optional[_Union[Budgets, _Mapping]] = ..., pool_size: _Optional[int] = ..., process_mode: _Optional[_Union[ProcessMode, str]] = ..., evaluation: _Optional[_Union[Evaluation, _Mapping]] = ..., egress: _Optional[_Union[Egress, _Mapping]] = ...) -> None: ...

class Evaluation(_message.Message):
    __slots__ = ("mode", "copy_paths", "verifier_files", "verifier_files_path", "env", "secret_options", "max_copy_bytes", "max_copy_entries")
    class EnvEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    MODE_FIELD_NUMBER: _ClassVar[int]
    COPY_PATHS_FIELD_NUMBER: _ClassVar[int]
    VERIFIER_FILES_FIELD_NUMBER: _ClassVar[int]
    VERIFIER_FILES_PATH_FIELD_NUMBER: _ClassVar[int]
    ENV_FIELD_NUMBER: _ClassVar[int]
    SECRET_OPTIONS_FIELD_NUMBER: _ClassVar[int]
    MAX_COPY_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_COPY_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    mode: VerifierMode
    copy_paths: _containers.RepeatedScalarFieldContainer[str]
    verifier_files: str
    verifier_files_path: str
    env: _containers.ScalarMap[str, str]
    secret_options: _containers.RepeatedScalarFieldContainer[str]
    max_copy_bytes: int
    max_copy_entries: int
    def __init__(self, mode: _Optional[_Union[VerifierMode, str]] = ..., copy_paths: _Optional[_Iterable[str]] = ..., verifier_files: _Optional[str] = ..., verifier_files_path: _Optional[str] = ..., env: _Optional[_Mapping[str, str]] = ..., secret_options: _Optional[_Iterable[str]] = ..., max_copy_bytes: _Optional[int] = ..., max_copy_entries: _Optional[int] = ...) -> None: ...

class Egress(_message.Message):
    __slots__ = ("allow", "limits")
    ALLOW_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    allow: _containers.RepeatedScalarFieldContainer[str]
    limits: EgressLimits
    def __init__(self, allow: _Optional[_Iterable[str]] = ..., limits: _Optional[_Union[EgressLimits, _Mapping]] = ...) -> None: ...

class EgressLimits(_message.Message):
    __slots__ = ("max_connections", "connections_per_second", "connection_burst", "max_bytes_up", "max_bytes_down", "bytes_per_second_up", "bytes_per_second_down", "idle_timeout_seconds")
    MAX_CONNECTIONS_FIELD_NUMBER: _ClassVar[int]
    CONNECTIONS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    CONNECTION_BURST_FIELD_NUMBER: _ClassVar[int]
    MAX_BYTES_UP_FIELD_NUMBER: _ClassVar[int]
    MAX_BYTES_DOWN_FIELD_NUMBER: _ClassVar[int]
    BYTES_PER_SECOND_UP_FIELD_NUMBER: _ClassVar[int]
    BYTES_PER_SECOND_DOWN_FIELD_NUMBER: _ClassVar[int]
    IDLE_TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    max_connections: int
    connections_per_second: float
    connection_burst: int
    max_bytes_up: int
    max_bytes_down: int
    bytes_per_second_up: int
    bytes_per_second_down: int
    idle_timeout_seconds: float
    def __init__(self, max_connections: _Optional[int] = ..., connections_per_second: _Optional[float] = ..., connection_burst: _Optional[int] = ..., max_bytes_up: _Optional[int] = ..., max_bytes_down: _Optional[int] = ..., bytes_per_second_up: _Optional[int] = ..., bytes_per_second_down: _Optional[int] = ..., idle_timeout_seconds: _Optional[float] = ...) -> None: ...

class Limits(_message.Message):
    __slots__ = ("memory_bytes", "pids", "cpus", "disk_bytes", "output_bytes", "step_timeout_seconds")
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    PIDS_FIELD_NUMBER: _ClassVar[int]
    CPUS_FIELD_NUMBER: _ClassVar[int]
    DISK_BYTES_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_BYTES_FIELD_NUMBER: _ClassVar[int]
    STEP_TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    memory_bytes: int
    pids: int
    cpus: float
    disk_bytes: int
    output_bytes: int
    step_timeout_seconds: float
    def __init__(self, memory_bytes: _Optional[int] = ..., pids: _Optional[int] = ..., cpus: _Optional[float] = ..., disk_bytes: _Optional[int] = ..., output_bytes: _Optional[int] = ..., step_timeout_seconds: _Optional[float] = ...) -> None: ...

class Budgets(_message.Message):
    __slots__ = ("max_steps", "max_seconds")
    MAX_STEPS_FIELD_NUMBER: _ClassVar[int]
    MAX_SECONDS_FIELD_NUMBER: _ClassVar[int]
    max_steps: int
    max_seconds: float
    def __init__(self, max_steps: _Optional[int] = ..., max_seconds: _Optional[float] = ...) -> None: ...

class EnvInfo(_message.Message):
    __slots__ = ("spec", "warm_count", "active_count", "not_ready", "waiting_for_capacity")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    WARM_COUNT_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_COUNT_FIELD_NUMBER: _ClassVar[int]
    NOT_READY_FIELD_NUMBER: _ClassVar[int]
    WAITING_FOR_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    spec: EnvSpec
    warm_count: int
    active_count: int
    not_ready: str
    waiting_for_capacity: str
    def __init__(self, spec: _Optional[_Union[EnvSpec, _Mapping]] = ..., warm_count: _Optional[int] = ..., active_count: _Optional[int] = ..., not_ready: _Optional[str] = ..., waiting_for_capacity: _Optional[str] = ...) -> None: ...

class ProcessCapture(_message.Message):
    __slots__ = ("pid", "command", "method", "reason", "saved", "unsaved_reason")
    PID_FIELD_NUMBER: _ClassVar[int]
    COMMAND_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    SAVED_FIELD_NUMBER: _ClassVar[int]
    UNSAVED_REASON_FIELD_NUMBER: _ClassVar[int]
    pid: int
    command: str
    method: CaptureMethod
    reason: str
    saved: bool
    unsaved_reason: str
    def __init__(self, pid: _Optional[int] = ..., command: _Optional[str] = ..., method: _Optional[_Union[CaptureMethod, str]] = ..., reason: _Optional[str] = ..., saved: _Optional[bool] = ..., unsaved_reason: _Optional[str] = ...) -> None: ...

class Sandbox(_message.Message):
    __slots__ = ("sandbox_id", "env", "episode_id", "run", "group_id", "state", "next_step_index", "start_checkpoint_id", "lease_expire_time", "create_time")
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    ENV_FIELD_NUMBER: _ClassVar[int]
    EPISODE_ID_FIELD_NUMBER: _ClassVar[int]
    RUN_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    NEXT_STEP_INDEX_FIELD_NUMBER: _ClassVar[int]
    START_CHECKPOINT_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRE_TIME_FIELD_NUMBER: _ClassVar[int]
    CREATE_TIME_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    env: str
    episode_id: str
    run: str
    group_id: str
    state: SandboxState
    next_step_index: int
    start_checkpoint_id: str
    lease_expire_time: _timestamp_pb2.Timestamp
    create_time: _timestamp_pb2.Timestamp
    def __init__(self, sandbox_id: _Optional[str] = ..., env: _Optional[str] = ..., episode_id: _Optional[str] = ..., run: _Optional[str] = ..., group_id: _Optional[str] = ..., state: _Optional[_Union[SandboxState, str]] = ..., next_step_index: _Optional[int] = ..., start_checkpoint_id: _Optional[str] = ..., lease_expire_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., create_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...
