from deltagym._proto.deltagym.v1 import action_pb2 as _action_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ChangeKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CHANGE_KIND_UNSPECIFIED: _ClassVar[ChangeKind]
    CHANGE_KIND_ADDED: _ClassVar[ChangeKind]
    CHANGE_KIND_REMOVED: _ClassVar[ChangeKind]
    CHANGE_KIND_MODIFIED: _ClassVar[ChangeKind]

class DiffDetail(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DIFF_DETAIL_UNSPECIFIED: _ClassVar[DiffDetail]
    DIFF_DETAIL_PATHS: _ClassVar[DiffDetail]
    DIFF_DETAIL_LINES: _ClassVar[DiffDetail]
    DIFF_DETAIL_UNIFIED: _ClassVar[DiffDetail]
CHANGE_KIND_UNSPECIFIED: ChangeKind
CHANGE_KIND_ADDED: ChangeKind
CHANGE_KIND_REMOVED: ChangeKind
CHANGE_KIND_MODIFIED: ChangeKind
DIFF_DETAIL_UNSPECIFIED: DiffDetail
DIFF_DETAIL_PATHS: DiffDetail
DIFF_DETAIL_LINES: DiffDetail
DIFF_DETAIL_UNIFIED: DiffDetail

class StateDigest(_message.Message):
    __slots__ = ("files", "processes")
    FILES_FIELD_NUMBER: _ClassVar[int]
    PROCESSES_FIELD_NUMBER: _ClassVar[int]
    files: str
    processes: str
    def __init__(self, files: _Optional[str] = ..., processes: _Optional[str] = ...) -> None: ...

class PathChange(_message.Message):
    __slots__ = ("path", "kind", "old_type", "new_type", "old_size", "new_size", "old_mode", "new_mode", "metadata_only", "binary", "lines_added", "lines_removed", "unified_diff")
    PATH_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    OLD_TYPE_FIELD_NUMBER: _ClassVar[int]
    NEW_TYPE_FIELD_NUMBER: _ClassVar[int]
    OLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    NEW_SIZE_FIELD_NUMBER: _ClassVar[int]
    OLD_MODE_FIELD_NUMBER: _ClassVar[int]
    NEW_MODE_FIELD_NUMBER: _ClassVar[int]
    METADATA_ONLY_FIELD_NUMBER: _ClassVar[int]
    BINARY_FIELD_NUMBER: _ClassVar[int]
    LINES_ADDED_FIELD_NUMBER: _ClassVar[int]
    LINES_REMOVED_FIELD_NUMBER: _ClassVar[int]
    UNIFIED_DIFF_FIELD_NUMBER: _ClassVar[int]
    path: str
    kind: ChangeKind
    old_type: _action_pb2.FileType
    new_type: _action_pb2.FileType
    old_size: int
    new_size: int
    old_mode: int
    new_mode: int
    metadata_only: bool
    binary: bool
    lines_added: int
    lines_removed: int
    unified_diff: str
    def __init__(self, path: _Optional[str] = ..., kind: _Optional[_Union[ChangeKind, str]] = ..., old_type: _Optional[_Union[_action_pb2.FileType, str]] = ..., new_type: _Optional[_Union[_action_pb2.FileType, str]] = ..., old_size: _Optional[int] = ..., new_size: _Optional[int] = ..., old_mode: _Optional[int] = ..., new_mode: _Optional[int] = ..., metadata_only: _Optional[bool] = ..., binary: _Optional[bool] = ..., lines_added: _Optional[int] = ..., lines_removed: _Optional[int] = ..., unified_diff: _Optional[str] = ...) -> None: ...

class ProcessChange(_message.Message):
    __slots__ = ("kind", "pid", "command", "details")
    KIND_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    COMMAND_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    kind: ChangeKind
    pid: int
    command: str
    details: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, kind: _Optional[_Union[ChangeKind, str]] = ..., pid: _Optional[int] = ..., command: _Optional[str] = ..., details: _Optional[_Iterable[str]] = ...) -> None: ...
