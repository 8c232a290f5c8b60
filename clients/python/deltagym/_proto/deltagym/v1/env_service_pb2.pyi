import datetime

from deltagym._proto.deltagym.v1 import action_pb2 as _action_pb2
from deltagym._proto.deltagym.v1 import env_pb2 as _env_pb2
from deltagym._proto.deltagym.v1 import state_pb2 as _state_pb2
from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ImageFormat(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    IMAGE_FORMAT_UNSPECIFIED: _ClassVar[ImageFormat]
    IMAGE_FORMAT_OCI_LAYOUT: _ClassVar[ImageFormat]
    IMAGE_FORMAT_DOCKER_ARCHIVE: _ClassVar[ImageFormat]
    IMAGE_FORMAT_ROOTFS_DIR: _ClassVar[ImageFormat]

class OutputStream(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    OUTPUT_STREAM_UNSPECIFIED: _ClassVar[OutputStream]
    OUTPUT_STREAM_STDOUT: _ClassVar[OutputStream]
    OUTPUT_STREAM_STDERR: _ClassVar[OutputStream]
IMAGE_FORMAT_UNSPECIFIED: ImageFormat
IMAGE_FORMAT_OCI_LAYOUT: ImageFormat
IMAGE_FORMAT_DOCKER_ARCHIVE: ImageFormat
IMAGE_FORMAT_ROOTFS_DIR: ImageFormat
OUTPUT_STREAM_UNSPECIFIED: OutputStream
OUTPUT_STREAM_STDOUT: OutputStream
OUTPUT_STREAM_STDERR: OutputStream

class ListEnvsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListEnvsResponse(_message.Message):
    __slots__ = ("envs",)
    ENVS_FIELD_NUMBER: _ClassVar[int]
    envs: _containers.RepeatedCompositeFieldContainer[_env_pb2.EnvInfo]
    def __init__(self, envs: _Optional[_Iterable[_Union[_env_pb2.EnvInfo, _Mapping]]] = ...) -> None: ...

class RegisterEnvRequest(_message.Message):
    __slots__ = ("spec", "replace")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    REPLACE_FIELD_NUMBER: _ClassVar[int]
    spec: _env_pb2.EnvSpec
    replace: bool
    def __init__(self, spec: _Optional[_Union[_env_pb2.EnvSpec, _Mapping]] = ..., replace: _Optional[bool] = ...) -> None: ...

class RegisterEnvResponse(_message.Message):
    __slots__ = ("env",)
    ENV_FIELD_NUMBER: _ClassVar[int]
    env: _env_pb2.EnvInfo
    def __init__(self, env: _Optional[_Union[_env_pb2.EnvInfo, _Mapping]] = ...) -> None: ...

class ImportImageRequest(_message.Message):
    __slots__ = ("name", "path", "format", "reference")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    REFERENCE_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    format: ImageFormat
    reference: str
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ..., format: _Optional[_Union[ImageFormat, str]] = ..., reference: _Optional[str] = ...) -> None: ...

class ImportImageResponse(_message.Message):
    __slots__ = ("name", "digest", "layer_count", "size_bytes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    LAYER_COUNT_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    digest: str
    layer_count: int
    size_bytes: int
    def __init__(self, name: _Optional[str] = ..., digest: _Optional[str] = ..., layer_count: _Optional[int] = ..., size_bytes: _Optional[int] = ...) -> None: ...

class ResetRequest(_message.Message):
    __slots__ = ("env", "seed", "options", "idempotency_key", "run", "group_id", "lease_ttl_seconds")
    class OptionsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ENV_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    IDEMPOTENCY_KEY_FIELD_NUMBER: _ClassVar[int]
    RUN_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    env: str
    seed: int
    options: _containers.ScalarMap[str, str]
    idempotency_key: str
    run: str
    group_id: str
    lease_ttl_seconds: float
    def __init__(self, env: _Optional[str] = ..., seed: _Optional[int] = ..., options: _Optional[_Mapping[str, str]] = ..., idempotency_key: _Optional[str] = ..., run: _Optional[str] = ..., group_id: _Optional[str] = ..., lease_ttl_seconds: _Optional[float] = ...) -> None: ...

class ResetResponse(_message.Message):
    __slots__ = ("sandbox_id", "episode_id", "checkpoint_id", "observation", "info", "lease_expire_time")
    class InfoEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    EPISODE_ID_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_ID_FIELD_NUMBER: _ClassVar[int]
    OBSERVATION_FIELD_NUMBER: _ClassVar[int]
    INFO_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRE_TIME_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    episode_id: str
    checkpoint_id: str
    observation: _action_pb2.Observation
    info: _containers.ScalarMap[str, str]
    lease_expire_time: _timestamp_pb2.Timestamp
    def __init__(self, sandbox_id: _Optional[str] = ..., episode_id: _Optional[str] = ..., checkpoint_id: _Optional[str] = ..., observation: _Optional[_Union[_action_pb2.Observation, _Mapping]] = ..., info: _Optional[_Mapping[str, str]] = ..., lease_expire_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("sandbox_id", "action", "checkpoint", "restore_checkpoint_id", "restore_fresh_entropy", "checkpoint_wait_for_digest", "checkpoint_dedupe", "setup")
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    RESTORE_CHECKPOINT_ID_FIELD_NUMBER: _ClassVar[int]
    RESTORE_FRESH_ENTROPY_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_WAIT_FOR_DIGEST_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_DEDUPE_FIELD_NUMBER: _ClassVar[int]
    SETUP_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    action: _action_pb2.Action
    checkpoint: bool
    restore_checkpoint_id: str
    restore_fresh_entropy: bool
    checkpoint_wait_for_digest: bool
    checkpoint_dedupe: bool
    setup: bool
    def __init__(self, sandbox_id: _Optional[str] = ..., action: _Optional[_Union[_action_pb2.Action, _Mapping]] = ..., checkpoint: _Optional[bool] = ..., restore_checkpoint_id: _Optional[str] = ..., restore_fresh_entropy: _Optional[bool] = ..., checkpoint_wait_for_digest: _Optional[bool] = ..., checkpoint_dedupe: _Optional[bool] = ..., setup: _Optional[bool] = ...) -> None: ...

class StepResponse(_message.Message):
    __slots__ = ("observation", "reward", "terminated", "truncated", "checkpoint_id", "info", "step_index", "episode_id", "steps_left", "checkpoint_digest", "checkpoint_deduplicated")
    class InfoEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    OBSERVATION_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    TERMINATED_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_ID_FIELD_NUMBER: _ClassVar[int]
    INFO_FIELD_NUMBER: _ClassVar[int]
    STEP_INDEX_FIELD_NUMBER: _ClassVar[int]
    EPISODE_ID_FIELD_NUMBER: _ClassVar[int]
    STEPS_LEFT_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_DIGEST_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_DEDUPLICATED_FIELD_NUMBER: _ClassVar[int]
    observation: _action_pb2.Observation
    reward: float
    terminated: bool
    truncated: bool
    checkpoint_id: str
    info: _containers.ScalarMap[str, str]
    step_index: int
    episode_id: str
    steps_left: int
    checkpoint_digest: _state_pb2.StateDigest
    checkpoint_deduplicated: bool
    def __init__(self, observation: _Optional[_Union[_action_pb2.Observation, _Mapping]] = ..., reward: _Optional[float] = ..., terminated: _Optional[bool] = ..., truncated: _Optional[bool] = ..., checkpoint_id: _Optional[str] = ..., info: _Optional[_Mapping[str, str]] = ..., step_index: _Optional[int] = ..., episode_id: _Optional[str] = ..., steps_left: _Optional[int] = ..., checkpoint_digest: _Optional[_Union[_state_pb2.StateDigest, _Mapping]] = ..., checkpoint_deduplicated: _Optional[bool] = ...) -> None: ...

class StreamStepRequest(_message.Message):
    __slots__ = ("step",)
    STEP_FIELD_NUMBER: _ClassVar[int]
    step: StepRequest
    def __init__(self, step: _Optional[_Union[StepRequest, _Mapping]] = ...) -> None: ...

class StreamStepResponse(_message.Message):
    __slots__ = ("output", "step")
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    output: OutputChunk
    step: StepResponse
    def __init__(self, output: _Optional[_Union[OutputChunk, _Mapping]] = ..., step: _Optional[_Union[StepResponse, _Mapping]] = ...) -> None: ...

class OutputChunk(_message.Message):
    __slots__ = ("stream", "data")
    STREAM_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    stream: OutputStream
    data: bytes
    def __init__(self, stream: _Optional[_Union[OutputStream, str]] = ..., data: _Optional[bytes] = ...) -> None: ...

class StepStreamRequest(_message.Message):
    __slots__ = ("request_id", "step")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    step: StepRequest
    def __init__(self, request_id: _Optional[int] = ..., step: _Optional[_Union[StepRequest, _Mapping]] = ...) -> None: ...

class StepStreamResponse(_message.Message):
    __slots__ = ("request_id", "step", "error")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    step: StepResponse
    error: ErrorStatus
    def __init__(self, request_id: _Optional[int] = ..., step: _Optional[_Union[StepResponse, _Mapping]] = ..., error: _Optional[_Union[ErrorStatus, _Mapping]] = ...) -> None: ...

class ErrorStatus(_message.Message):
    __slots__ = ("code", "message", "reason")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    reason: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class CheckpointRequest(_message.Message):
    __slots__ = ("sandbox_id", "durable", "process_mode", "wait_for_digest", "dedupe")
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    DURABLE_FIELD_NUMBER: _ClassVar[int]
    PROCESS_MODE_FIELD_NUMBER: _ClassVar[int]
    WAIT_FOR_DIGEST_FIELD_NUMBER: _ClassVar[int]
    DEDUPE_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    durable: bool
    process_mode: _env_pb2.ProcessMode
    wait_for_digest: bool
    dedupe: bool
    def __init__(self, sandbox_id: _Optional[str] = ..., durable: _Optional[bool] = ..., process_mode: _Optional[_Union[_env_pb2.ProcessMode, str]] = ..., wait_for_digest: _Optional[bool] = ..., dedupe: _Optional[bool] = ...) -> None: ...

class CheckpointResponse(_message.Message):
    __slots__ = ("checkpoint_id", "parent_id", "depth", "processes", "durable", "digest", "deduplicated")
    CHECKPOINT_ID_FIELD_NUMBER: _ClassVar[int]
    PARENT_ID_FIELD_NUMBER: _ClassVar[int]
    DEPTH_FIELD_NUMBER: _ClassVar[int]
    PROCESSES_FIELD_NUMBER: _ClassVar[int]
    DURABLE_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    DEDUPLICATED_FIELD_NUMBER: _ClassVar[int]
    checkpoint_id: str
    parent_id: str
    depth: int
    processes: _containers.RepeatedCompositeFieldContainer[_env_pb2.ProcessCapture]
    durable: bool
    digest: _state_pb2.StateDigest
    deduplicated: bool
    def __init__(self, checkpoint_id: _Optional[str] = ..., parent_id: _Optional[str] = ..., depth: _Optional[int] = ..., processes: _Optional[_Iterable[_Union[_env_pb2.ProcessCapture, _Mapping]]] = ..., durable: _Optional[bool] = ..., digest: _Optional[_Union[_state_pb2.StateDigest, _Mapping]] = ..., deduplicated: _Optional[bool] = ...) -> None: ...

class RestoreRequest(_message.Message):
    __slots__ = ("sandbox_id", "checkpoint_id", "fresh_entropy")
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_ID_FIELD_NUMBER: _ClassVar[int]
    FRESH_ENTROPY_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    checkpoint_id: str
    fresh_entropy: bool
    def __init__(self, sandbox_id: _Optional[str] = ..., checkpoint_id: _Optional[str] = ..., fresh_entropy: _Optional[bool] = ...) -> None: ...

class RestoreResponse(_message.Message):
    __slots__ = ("episode_id", "next_step_index")
    EPISODE_ID_FIELD_NUMBER: _ClassVar[int]
    NEXT_STEP_INDEX_FIELD_NUMBER: _ClassVar[int]
    episode_id: str
    next_step_index: int
    def __init__(self, episode_id: _Optional[str] = ..., next_step_index: _Optional[int] = ...) -> None: ...

class ForkRequest(_message.Message):
    __slots__ = ("checkpoint_id", "sandbox_id", "n", "group_id", "run", "idempotency_key", "fresh_entropy", "lease_ttl_seconds")
    CHECKPOINT_ID_FIELD_NUMBER: _ClassVar[int]
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    RUN_FIELD_NUMBER: _ClassVar[int]
    IDEMPOTENCY_KEY_FIELD_NUMBER: _ClassVar[int]
    FRESH_ENTROPY_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    checkpoint_id: str
    sandbox_id: str
    n: int
    group_id: str
    run: str
    idempotency_key: str
    fresh_entropy: bool
    lease_ttl_seconds: float
    def __init__(self, checkpoint_id: _Optional[str] = ..., sandbox_id: _Optional[str] = ..., n: _Optional[int] = ..., group_id: _Optional[str] = ..., run: _Optional[str] = ..., idempotency_key: _Optional[str] = ..., fresh_entropy: _Optional[bool] = ..., lease_ttl_seconds: _Optional[float] = ...) -> None: ...

class ForkResponse(_message.Message):
    __slots__ = ("sandbox_ids", "episode_ids", "checkpoint_id", "processes")
    SANDBOX_IDS_FIELD_NUMBER: _ClassVar[int]
    EPISODE_IDS_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_ID_FIELD_NUMBER: _ClassVar[int]
    PROCESSES_FIELD_NUMBER: _ClassVar[int]
    sandbox_ids: _containers.RepeatedScalarFieldContainer[str]
    episode_ids: _containers.RepeatedScalarFieldContainer[str]
    checkpoint_id: str
    processes: _containers.RepeatedCompositeFieldContainer[_env_pb2.ProcessCapture]
    def __init__(self, sandbox_ids: _Optional[_Iterable[str]] = ..., episode_ids: _Optional[_Iterable[str]] = ..., checkpoint_id: _Optional[str] = ..., processes: _Optional[_Iterable[_Union[_env_pb2.ProcessCapture, _Mapping]]] = ...) -> None: ...

class ReleaseCheckpointRequest(_message.Message):
    __slots__ = ("checkpoint_id",)
    CHECKPOINT_ID_FIELD_NUMBER: _ClassVar[int]
    checkpoint_id: str
    def __init__(self, checkpoint_id: _Optional[str] = ...) -> None: ...

class ReleaseCheckpointResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EvaluateRequest(_message.Message):
    __slots__ = ("sandbox_id",)
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    def __init__(self, sandbox_id: _Optional[str] = ...) -> None: ...

class EvaluateResponse(_message.Message):
    __slots__ = ("reward", "components", "output", "duration_seconds")
    class ComponentsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    REWARD_FIELD_NUMBER: _ClassVar[int]
    COMPONENTS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    DURATION_SECONDS_FIELD_NUMBER: _ClassVar[int]
    reward: float
    components: _containers.ScalarMap[str, float]
    output: str
    duration_seconds: float
    def __init__(self, reward: _Optional[float] = ..., components: _Optional[_Mapping[str, float]] = ..., output: _Optional[str] = ..., duration_seconds: _Optional[float] = ...) -> None: ...

class CloseRequest(_message.Message):
    __slots__ = ("sandbox_id",)
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    def __init__(self, sandbox_id: _Optional[str] = ...) -> None: ...

class CloseResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("sandbox_ids", "lease_ttl_seconds")
    SANDBOX_IDS_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    sandbox_ids: _containers.RepeatedScalarFieldContainer[str]
    lease_ttl_seconds: float
    def __init__(self, sandbox_ids: _Optional[_Iterable[str]] = ..., lease_ttl_seconds: _Optional[float] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("leases", "unknown_sandbox_ids")
    LEASES_FIELD_NUMBER: _ClassVar[int]
    UNKNOWN_SANDBOX_IDS_FIELD_NUMBER: _ClassVar[int]
    leases: _containers.RepeatedCompositeFieldContainer[Lease]
    unknown_sandbox_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, leases: _Optional[_Iterable[_Union[Lease, _Mapping]]] = ..., unknown_sandbox_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class Lease(_message.Message):
    __slots__ = ("sandbox_id", "expire_time")
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    EXPIRE_TIME_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    expire_time: _timestamp_pb2.Timestamp
    def __init__(self, sandbox_id: _Optional[str] = ..., expire_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class GetSandboxRequest(_message.Message):
    __slots__ = ("sandbox_id",)
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    def __init__(self, sandbox_id: _Optional[str] = ...) -> None: ...

class GetSandboxResponse(_message.Message):
    __slots__ = ("sandbox",)
    SANDBOX_FIELD_NUMBER: _ClassVar[int]
    sandbox: _env_pb2.Sandbox
    def __init__(self, sandbox: _Optional[_Union[_env_pb2.Sandbox, _Mapping]] = ...) -> None: ...

class ListSandboxesRequest(_message.Message):
    __slots__ = ("env", "run", "group_id")
    ENV_FIELD_NUMBER: _ClassVar[int]
    RUN_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    env: str
    run: str
    group_id: str
    def __init__(self, env: _Optional[str] = ..., run: _Optional[str] = ..., group_id: _Optional[str] = ...) -> None: ...

class ListSandboxesResponse(_message.Message):
    __slots__ = ("sandboxes",)
    SANDBOXES_FIELD_NUMBER: _ClassVar[int]
    sandboxes: _containers.RepeatedCompositeFieldContainer[_env_pb2.Sandbox]
    def __init__(self, sandboxes: _Optional[_Iterable[_Union[_env_pb2.Sandbox, _Mapping]]] = ...) -> None: ...

class ListCheckpointsRequest(_message.Message):
    __slots__ = ("env", "run", "group_id", "episode_id")
    ENV_FIELD_NUMBER: _ClassVar[int]
    RUN_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    EPISODE_ID_FIELD_NUMBER: _ClassVar[int]
    env: str
    run: str
    group_id: str
    episode_id: str
    def __init__(self, env: _Optional[str] = ..., run: _Optional[str] = ..., group_id: _Optional[str] = ..., episode_id: _Optional[str] = ...) -> None: ...

class ListCheckpointsResponse(_message.Message):
    __slots__ = ("checkpoints",)
    CHECKPOINTS_FIELD_NUMBER: _ClassVar[int]
    checkpoints: _containers.RepeatedCompositeFieldContainer[CheckpointSummary]
    def __init__(self, checkpoints: _Optional[_Iterable[_Union[CheckpointSummary, _Mapping]]] = ...) -> None: ...

class CheckpointSummary(_message.Message):
    __slots__ = ("checkpoint_id", "parent_id", "env", "episode_id", "run", "group_id", "step_index", "create_time", "size_bytes", "depth", "processes", "pinned", "live_descendants", "last_used_time", "expire_time", "digest")
    CHECKPOINT_ID_FIELD_NUMBER: _ClassVar[int]
    PARENT_ID_FIELD_NUMBER: _ClassVar[int]
    ENV_FIELD_NUMBER: _ClassVar[int]
    EPISODE_ID_FIELD_NUMBER: _ClassVar[int]
    RUN_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_INDEX_FIELD_NUMBER: _ClassVar[int]
    CREATE_TIME_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEPTH_FIELD_NUMBER: _ClassVar[int]
    PROCESSES_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    LIVE_DESCENDANTS_FIELD_NUMBER: _ClassVar[int]
    LAST_USED_TIME_FIELD_NUMBER: _ClassVar[int]
    EXPIRE_TIME_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    checkpoint_id: str
    parent_id: str
    env: str
    episode_id: str
    run: str
    group_id: str
    step_index: int
    create_time: _timestamp_pb2.Timestamp
    size_bytes: int
    depth: int
    processes: int
    pinned: bool
    live_descendants: int
    last_used_time: _timestamp_pb2.Timestamp
    expire_time: _timestamp_pb2.Timestamp
    digest: _state_pb2.StateDigest
    def __init__(self, checkpoint_id: _Optional[str] = ..., parent_id: _Optional[str] = ..., env: _Optional[str] = ..., episode_id: _Optional[str] = ..., run: _Optional[str] = ..., group_id: _Optional[str] = ..., step_index: _Optional[int] = ..., create_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., size_bytes: _Optional[int] = ..., depth: _Optional[int] = ..., processes: _Optional[int] = ..., pinned: _Optional[bool] = ..., live_descendants: _Optional[int] = ..., last_used_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., expire_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., digest: _Optional[_Union[_state_pb2.StateDigest, _Mapping]] = ...) -> None: ...

class DiffCheckpointsRequest(_message.Message):
    __slots__ = ("base_checkpoint_id", "checkpoint_id", "detail", "path", "max_paths")
    BASE_CHECKPOINT_ID_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_ID_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    MAX_PATHS_FIELD_NUMBER: _ClassVar[int]
    base_checkpoint_id: str
    checkpoint_id: str
    detail: _state_pb2.DiffDetail
    path: str
    max_paths: int
    def __init__(self, base_checkpoint_id: _Optional[str] = ..., checkpoint_id: _Optional[str] = ..., detail: _Optional[_Union[_state_pb2.DiffDetail, str]] = ..., path: _Optional[str] = ..., max_paths: _Optional[int] = ...) -> None: ...

class DiffCheckpointsResponse(_message.Message):
    __slots__ = ("paths", "truncated", "processes", "base_digest", "digest", "details_truncated")
    PATHS_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    PROCESSES_FIELD_NUMBER: _ClassVar[int]
    BASE_DIGEST_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    DETAILS_TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    paths: _containers.RepeatedCompositeFieldContainer[_state_pb2.PathChange]
    truncated: bool
    processes: _containers.RepeatedCompositeFieldContainer[_state_pb2.ProcessChange]
    base_digest: _state_pb2.StateDigest
    digest: _state_pb2.StateDigest
    details_truncated: bool
    def __init__(self, paths: _Optional[_Iterable[_Union[_state_pb2.PathChange, _Mapping]]] = ..., truncated: _Optional[bool] = ..., processes: _Optional[_Iterable[_Union[_state_pb2.ProcessChange, _Mapping]]] = ..., base_digest: _Optional[_Union[_state_pb2.StateDigest, _Mapping]] = ..., digest: _Optional[_Union[_state_pb2.StateDigest, _Mapping]] = ..., details_truncated: _Optional[bool] = ...) -> None: ...
