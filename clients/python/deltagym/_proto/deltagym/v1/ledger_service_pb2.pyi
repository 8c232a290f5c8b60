import datetime

from deltagym._proto.deltagym.v1 import action_pb2 as _action_pb2
from deltagym._proto.deltagym.v1 import state_pb2 as _state_pb2
from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class EpisodeStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    EPISODE_STATUS_UNSPECIFIED: _ClassVar[EpisodeStatus]
    EPISODE_STATUS_RUNNING: _ClassVar[EpisodeStatus]
    EPISODE_STATUS_TERMINATED: _ClassVar[EpisodeStatus]
    EPISODE_STATUS_TRUNCATED: _ClassVar[EpisodeStatus]
    EPISODE_STATUS_BRANCHED: _ClassVar[EpisodeStatus]
    EPISODE_STATUS_FAILED: _ClassVar[EpisodeStatus]

class FailureClass(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FAILURE_CLASS_UNSPECIFIED: _ClassVar[FailureClass]
    FAILURE_CLASS_INFRA: _ClassVar[FailureClass]
    FAILURE_CLASS_AGENT: _ClassVar[FailureClass]
    FAILURE_CLASS_VERIFIER: _ClassVar[FailureClass]

class CheckpointKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CHECKPOINT_KIND_UNSPECIFIED: _ClassVar[CheckpointKind]
    CHECKPOINT_KIND_USER: _ClassVar[CheckpointKind]
    CHECKPOINT_KIND_POOL: _ClassVar[CheckpointKind]
    CHECKPOINT_KIND_TASK: _ClassVar[CheckpointKind]
    CHECKPOINT_KIND_EVALUATE: _ClassVar[CheckpointKind]
EPISODE_STATUS_UNSPECIFIED: EpisodeStatus
EPISODE_STATUS_RUNNING: EpisodeStatus
EPISODE_STATUS_TERMINATED: EpisodeStatus
EPISODE_STATUS_TRUNCATED: EpisodeStatus
EPISODE_STATUS_BRANCHED: EpisodeStatus
EPISODE_STATUS_FAILED: EpisodeStatus
FAILURE_CLASS_UNSPECIFIED: FailureClass
FAILURE_CLASS_INFRA: FailureClass
FAILURE_CLASS_AGENT: FailureClass
FAILURE_CLASS_VERIFIER: FailureClass
CHECKPOINT_KIND_UNSPECIFIED: CheckpointKind
CHECKPOINT_KIND_USER: CheckpointKind
CHECKPOINT_KIND_POOL: CheckpointKind
CHECKPOINT_KIND_TASK: CheckpointKind
CHECKPOINT_KIND_EVALUATE: CheckpointKind

class Episode(_message.Message):
    __slots__ = ("episode_id", "env", "run", "group_id", "seed", "sandbox_id", "start_checkpoint_id", "parent_episode_id", "status", "failure_class", "failure_message", "total_reward", "step_count", "rewards", "start_time", "end_time")
    EPISODE_ID_FIELD_NUMBER: _ClassVar[int]
    ENV_FIELD_NUMBER: _ClassVar[int]
    RUN_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    START_CHECKPOINT_ID_FIELD_NUMBER: _ClassVar[int]
    PARENT_EPISODE_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    FAILURE_CLASS_FIELD_NUMBER: _ClassVar[int]
    FAILURE_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    TOTAL_REWARD_FIELD_NUMBER: _ClassVar[int]
    STEP_COUNT_FIELD_NUMBER: _ClassVar[int]
    REWARDS_FIELD_NUMBER: _ClassVar[int]
    START_TIME_FIELD_NUMBER: _ClassVar[int]
    END_TIME_FIELD_NUMBER: _ClassVar[int]
    episode_id: str
    env: str
    run: str
    group_id: str
    seed: int
    sandbox_id: str
    start_checkpoint_id: str
    parent_episode_id: str
    status: EpisodeStatus
    failure_class: FailureClass
    failure_message: str
    total_reward: float
    step_count: int
    rewards: _containers.RepeatedCompositeFieldContainer[ReportedReward]
    start_time: _timestamp_pb2.Timestamp
    end_time: _timestamp_pb2.Timestamp
    def __init__(self, episode_id: _Optional[str] = ..., env: _Optional[str] = ..., run: _Optional[str] = ..., group_id: _Optional[str] = ..., seed: _Optional[int] = ..., sandbox_id: _Optional[str] = ..., start_checkpoint_id: _Optional[str] = ..., parent_episode_id: _Optional[str] = ..., status: _Optional[_Union[EpisodeStatus, str]] = ..., failure_class: _Optional[_Union[FailureClass, str]] = ..., failure_message: _Optional[str] = ..., total_reward: _Optional[float] = ..., step_count: _Optional[int] = ..., rewards: _Optional[_Iterable[_Union[ReportedReward, _Mapping]]] = ..., start_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., end_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class ReportedReward(_message.Message):
    __slots__ = ("name", "value", "source", "report_time")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    REPORT_TIME_FIELD_NUMBER: _ClassVar[int]
    name: str
    value: float
    source: str
    report_time: _timestamp_pb2.Timestamp
    def __init__(self, name: _Optional[str] = ..., value: _Optional[float] = ..., source: _Optional[str] = ..., report_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class TrajectoryStep(_message.Message):
    __slots__ = ("step_index", "episode_id", "inherited", "action", "observation", "observation_size_bytes", "observation_sha256", "reward", "terminated", "truncated", "start_time", "duration_seconds", "checkpoint_id", "action_bulk_size_bytes", "action_bulk_sha256", "setup")
    STEP_INDEX_FIELD_NUMBER: _ClassVar[int]
    EPISODE_ID_FIELD_NUMBER: _ClassVar[int]
    INHERITED_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    OBSERVATION_FIELD_NUMBER: _ClassVar[int]
    OBSERVATION_SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    OBSERVATION_SHA256_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    TERMINATED_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    START_TIME_FIELD_NUMBER: _ClassVar[int]
    DURATION_SECONDS_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_ID_FIELD_NUMBER: _ClassVar[int]
    ACTION_BULK_SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    ACTION_BULK_SHA256_FIELD_NUMBER: _ClassVar[int]
    SETUP_FIELD_NUMBER: _ClassVar[int]
    step_index: int
    episode_id: str
    inherited: bool
    action: _action_pb2.Action
    observation: _action_pb2.Observation
    observation_size_bytes: int
    observation_sha256: str
    reward: float
    terminated: bool
    truncated: bool
    start_time: _timestamp_pb2.Timestamp
    duration_seconds: float
    checkpoint_id: str
    action_bulk_size_bytes: int
    action_bulk_sha256: str
    setup: bool
    def __init__(self, step_index: _Optional[int] = ..., episode_id: _Optional[str] = ..., inherited: _Optional[bool] = ..., action: _Optional[_Union[_action_pb2.Action, _Mapping]] = ..., observation: _Optional[_Union[_action_pb2.Observation, _Mapping]] = ..., observation_size_bytes: _Optional[int] = ..., observation_sha256: _Optional[str] = ..., reward: _Optional[float] = ..., terminated: _Optional[bool] = ..., truncated: _Optional[bool] = ..., start_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., duration_seconds: _Optional[float] = ..., checkpoint_id: _Optional[str] = ..., action_bulk_size_bytes: _Optional[int] = ..., action_bulk_sha256: _Optional[str] = ..., setup: _Optional[bool] = ...) -> None: ...

class CheckpointNode(_message.Message):
    __slots__ = ("checkpoint_id", "parent_id", "kind", "sandbox_id", "episode_id", "step_index", "create_time", "released", "parent_ids", "digest")
    CHECKPOINT_ID_FIELD_NUMBER: _ClassVar[int]
    PARENT_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    EPISODE_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_INDEX_FIELD_NUMBER: _ClassVar[int]
    CREATE_TIME_FIELD_NUMBER: _ClassVar[int]
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    PARENT_IDS_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    checkpoint_id: str
    parent_id: str
    kind: CheckpointKind
    sandbox_id: str
    episode_id: str
    step_index: int
    create_time: _timestamp_pb2.Timestamp
    released: bool
    parent_ids: _containers.RepeatedScalarFieldContainer[str]
    digest: _state_pb2.StateDigest
    def __init__(self, checkpoint_id: _Optional[str] = ..., parent_id: _Optional[str] = ..., kind: _Optional[_Union[CheckpointKind, str]] = ..., sandbox_id: _Optional[str] = ..., episode_id: _Optional[str] = ..., step_index: _Optional[int] = ..., create_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., released: _Optional[bool] = ..., parent_ids: _Optional[_Iterable[str]] = ..., digest: _Optional[_Union[_state_pb2.StateDigest, _Mapping]] = ...) -> None: ...

class ListEpisodesRequest(_message.Message):
    __slots__ = ("run", "group_id", "env", "page_size", "page_token")
    RUN_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    ENV_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    run: str
    group_id: str
    env: str
    page_size: int
    page_token: str
    def __init__(self, run: _Optional[str] = ..., group_id: _Optional[str] = ..., env: _Optional[str] = ..., page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class ListEpisodesResponse(_message.Message):
    __slots__ = ("episodes", "next_page_token")
    EPISODES_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    episodes: _containers.RepeatedCompositeFieldContainer[Episode]
    next_page_token: str
    def __init__(self, episodes: _Optional[_Iterable[_Union[Episode, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class GetTrajectoryRequest(_message.Message):
    __slots__ = ("episode_id",)
    EPISODE_ID_FIELD_NUMBER: _ClassVar[int]
    episode_id: str
    def __init__(self, episode_id: _Optional[str] = ...) -> None: ...

class GetTrajectoryResponse(_message.Message):
    __slots__ = ("episode", "steps")
    EPISODE_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    episode: Episode
    steps: _containers.RepeatedCompositeFieldContainer[TrajectoryStep]
    def __init__(self, episode: _Optional[_Union[Episode, _Mapping]] = ..., steps: _Optional[_Iterable[_Union[TrajectoryStep, _Mapping]]] = ...) -> None: ...

class GetCheckpointTreeRequest(_message.Message):
    __slots__ = ("run", "episode_id")
    RUN_FIELD_NUMBER: _ClassVar[int]
    EPISODE_ID_FIELD_NUMBER: _ClassVar[int]
    run: str
    episode_id: str
    def __init__(self, run: _Optional[str] = ..., episode_id: _Optional[str] = ...) -> None: ...

class GetCheckpointTreeResponse(_message.Message):
    __slots__ = ("nodes",)
    NODES_FIELD_NUMBER: _ClassVar[int]
    nodes: _containers.RepeatedCompositeFieldContainer[CheckpointNode]
    def __init__(self, nodes: _Optional[_Iterable[_Union[CheckpointNode, _Mapping]]] = ...) -> None: ...

class GetGroupAdvantagesRequest(_message.Message):
    __slots__ = ("group_id", "reward_source")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    REWARD_SOURCE_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    reward_source: str
    def __init__(self, group_id: _Optional[str] = ..., reward_source: _Optional[str] = ...) -> None: ...

class GroupAdvantage(_message.Message):
    __slots__ = ("episode_id", "reward", "advantage", "counted", "reason")
    EPISODE_ID_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    ADVANTAGE_FIELD_NUMBER: _ClassVar[int]
    COUNTED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    episode_id: str
    reward: float
    advantage: float
    counted: bool
    reason: str
    def __init__(self, episode_id: _Optional[str] = ..., reward: _Optional[float] = ..., advantage: _Optional[float] = ..., counted: _Optional[bool] = ..., reason: _Optional[str] = ...) -> None: ...

class GetGroupAdvantagesResponse(_message.Message):
    __slots__ = ("advantages", "mean", "std", "counted_count")
    ADVANTAGES_FIELD_NUMBER: _ClassVar[int]
    MEAN_FIELD_NUMBER: _ClassVar[int]
    STD_FIELD_NUMBER: _ClassVar[int]
    COUNTED_COUNT_FIELD_NUMBER: _ClassVar[int]
    advantages: _containers.RepeatedCompositeFieldContainer[GroupAdvantage]
    mean: float
    std: float
    counted_count: int
    def __init__(self, advantages: _Optional[_Iterable[_Union[GroupAdvantage, _Mapping]]] = ..., mean: _Optional[float] = ..., std: _Optional[float] = ..., counted_count: _Optional[int] = ...) -> None: ...

class ReportRewardRequest(_message.Message):
    __slots__ = ("episode_id", "name", "value", "source")
    EPISODE_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    episode_id: str
    name: str
    value: float
    source: str
    def __init__(self, episode_id: _Optional[str] = ..., name: _Optional[str] = ..., value: _Optional[float] = ..., source: _Optional[str] = ...) -> None: ...

class ReportRewardResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
