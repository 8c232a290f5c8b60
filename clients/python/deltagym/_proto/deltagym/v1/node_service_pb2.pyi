import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GetNodeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetNodeResponse(_message.Message):
    __slots__ = ("node",)
    NODE_FIELD_NUMBER: _ClassVar[int]
    node: NodeInfo
    def __init__(self, node: _Optional[_Union[NodeInfo, _Mapping]] = ...) -> None: ...

class NodeInfo(_message.Message):
    __slots__ = ("name", "address", "version", "draining", "sandboxes", "max_sandboxes", "checkpoints", "cpus", "cpu_load", "memory_available_bytes", "memory_total_bytes", "measured_at")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    SANDBOXES_FIELD_NUMBER: _ClassVar[int]
    MAX_SANDBOXES_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINTS_FIELD_NUMBER: _ClassVar[int]
    CPUS_FIELD_NUMBER: _ClassVar[int]
    CPU_LOAD_FIELD_NUMBER: _ClassVar[int]
    MEMORY_AVAILABLE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEASURED_AT_FIELD_NUMBER: _ClassVar[int]
    name: str
    address: str
    version: str
    draining: bool
    sandboxes: int
    max_sandboxes: int
    checkpoints: int
    cpus: int
    cpu_load: float
    memory_available_bytes: int
    memory_total_bytes: int
    measured_at: _timestamp_pb2.Timestamp
    def __init__(self, name: _Optional[str] = ..., address: _Optional[str] = ..., version: _Optional[str] = ..., draining: _Optional[bool] = ..., sandboxes: _Optional[int] = ..., max_sandboxes: _Optional[int] = ..., checkpoints: _Optional[int] = ..., cpus: _Optional[int] = ..., cpu_load: _Optional[float] = ..., memory_available_bytes: _Optional[int] = ..., memory_total_bytes: _Optional[int] = ..., measured_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...
