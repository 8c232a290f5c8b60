from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FileType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FILE_TYPE_UNSPECIFIED: _ClassVar[FileType]
    FILE_TYPE_FILE: _ClassVar[FileType]
    FILE_TYPE_DIRECTORY: _ClassVar[FileType]
    FILE_TYPE_SYMLINK: _ClassVar[FileType]
    FILE_TYPE_OTHER: _ClassVar[FileType]
FILE_TYPE_UNSPECIFIED: FileType
FILE_TYPE_FILE: FileType
FILE_TYPE_DIRECTORY: FileType
FILE_TYPE_SYMLINK: FileType
FILE_TYPE_OTHER: FileType

class Action(_message.Message):
    __slots__ = ("exec", "write_file", "read_file", "submit", "list_dir", "stat", "remove", "make_dir", "upload", "download", "list_processes", "signal")
    EXEC_FIELD_NUMBER: _ClassVar[int]
    WRITE_FILE_FIELD_NUMBER: _ClassVar[int]
    READ_FILE_FIELD_NUMBER: _ClassVar[int]
    SUBMIT_FIELD_NUMBER: _ClassVar[int]
    LIST_DIR_FIELD_NUMBER: _ClassVar[int]
    STAT_FIELD_NUMBER: _ClassVar[int]
    REMOVE_FIELD_NUMBER: _ClassVar[int]
    MAKE_DIR_FIELD_NUMBER: _ClassVar[int]
    UPLOAD_FIELD_NUMBER: _ClassVar[int]
    DOWNLOAD_FIELD_NUMBER: _ClassVar[int]
    LIST_PROCESSES_FIELD_NUMBER: _ClassVar[int]
    SIGNAL_FIELD_NUMBER: _ClassVar[int]
    exec: ExecAction
    write_file: WriteFileAction
    read_file: ReadFileAction
    submit: SubmitAction
    list_dir: ListDirAction
    stat: StatAction
    remove: RemoveAction
    make_dir: MakeDirAction
    upload: UploadAction
    download: DownloadAction
    list_processes: ListProcessesAction
    signal: SignalAction
    def __init__(self, exec: _Optional[_Union[ExecAction, _Mapping]] = ..., write_file: _Optional[_Union[WriteFileAction, _Mapping]] = ..., read_file: _Optional[_Union[ReadFileAction, _Mapping]] = ..., submit: _Optional[_Union[SubmitAction, _Mapping]] = ..., list_dir: _Optional[_Union[ListDirAction, _Mapping]] = ..., stat: _Optional[_Union[StatAction, _Mapping]] = ..., remove: _Optional[_Union[RemoveAction, _Mapping]] = ..., make_dir: _Optional[_Union[MakeDirAction, _Mapping]] = ..., upload: _Optional[_Union[UploadAction, _Mapping]] = ..., download: _Optional[_Union[DownloadAction, _Mapping]] = ..., list_processes: _Optional[_Union[ListProcessesAction, _Mapping]] = ..., signal: _Optional[_Union[SignalAction, _Mapping]] = ...) -> None: ...

class ExecAction(_message.Message):
    __slots__ = ("command", "argv", "stdin", "env", "cwd", "timeout_seconds", "background", "session", "interactive", "expect", "interrupt")
    class EnvEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    COMMAND_FIELD_NUMBER: _ClassVar[int]
    ARGV_FIELD_NUMBER: _ClassVar[int]
    STDIN_FIELD_NUMBER: _ClassVar[int]
    ENV_FIELD_NUMBER: _ClassVar[int]
    CWD_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    BACKGROUND_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    INTERACTIVE_FIELD_NUMBER: _ClassVar[int]
    EXPECT_FIELD_NUMBER: _ClassVar[int]
    INTERRUPT_FIELD_NUMBER: _ClassVar[int]
    command: str
    argv: _containers.RepeatedScalarFieldContainer[str]
    stdin: bytes
    env: _containers.ScalarMap[str, str]
    cwd: str
    timeout_seconds: float
    background: bool
    session: str
    interactive: bool
    expect: _containers.RepeatedScalarFieldContainer[str]
    interrupt: bool
    def __init__(self, command: _Optional[str] = ..., argv: _Optional[_Iterable[str]] = ..., stdin: _Optional[bytes] = ..., env: _Optional[_Mapping[str, str]] = ..., cwd: _Optional[str] = ..., timeout_seconds: _Optional[float] = ..., background: _Optional[bool] = ..., session: _Optional[str] = ..., interactive: _Optional[bool] = ..., expect: _Optional[_Iterable[str]] = ..., interrupt: _Optional[bool] = ...) -> None: ...

class WriteFileAction(_message.Message):
    __slots__ = ("path", "content", "mode", "append")
    PATH_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    APPEND_FIELD_NUMBER: _ClassVar[int]
    path: str
    content: bytes
    mode: int
    append: bool
    def __init__(self, path: _Optional[str] = ..., content: _Optional[bytes] = ..., mode: _Optional[int] = ..., append: _Optional[bool] = ...) -> None: ...

class ReadFileAction(_message.Message):
    __slots__ = ("path", "offset", "max_bytes")
    PATH_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    MAX_BYTES_FIELD_NUMBER: _ClassVar[int]
    path: str
    offset: int
    max_bytes: int
    def __init__(self, path: _Optional[str] = ..., offset: _Optional[int] = ..., max_bytes: _Optional[int] = ...) -> None: ...

class SubmitAction(_message.Message):
    __slots__ = ("answer",)
    ANSWER_FIELD_NUMBER: _ClassVar[int]
    answer: str
    def __init__(self, answer: _Optional[str] = ...) -> None: ...

class Observation(_message.Message):
    __slots__ = ("exec", "write_file", "read_file", "submit", "reset", "list_dir", "stat", "remove", "make_dir", "upload", "download", "list_processes", "signal", "error")
    EXEC_FIELD_NUMBER: _ClassVar[int]
    WRITE_FILE_FIELD_NUMBER: _ClassVar[int]
    READ_FILE_FIELD_NUMBER: _ClassVar[int]
    SUBMIT_FIELD_NUMBER: _ClassVar[int]
    RESET_FIELD_NUMBER: _ClassVar[int]
    LIST_DIR_FIELD_NUMBER: _ClassVar[int]
    STAT_FIELD_NUMBER: _ClassVar[int]
    REMOVE_FIELD_NUMBER: _ClassVar[int]
    MAKE_DIR_FIELD_NUMBER: _ClassVar[int]
    UPLOAD_FIELD_NUMBER: _ClassVar[int]
    DOWNLOAD_FIELD_NUMBER: _ClassVar[int]
    LIST_PROCESSES_FIELD_NUMBER: _ClassVar[int]
    SIGNAL_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    exec: ExecResult
    write_file: WriteFileResult
    read_file: ReadFileResult
    submit: SubmitResult
    reset: ResetResult
    list_dir: ListDirResult
    stat: StatResult
    remove: RemoveResult
    make_dir: MakeDirResult
    upload: UploadResult
    download: DownloadResult
    list_processes: ListProcessesResult
    signal: SignalResult
    error: ActionError
    def __init__(self, exec: _Optional[_Union[ExecResult, _Mapping]] = ..., write_file: _Optional[_Union[WriteFileResult, _Mapping]] = ..., read_file: _Optional[_Union[ReadFileResult, _Mapping]] = ..., submit: _Optional[_Union[SubmitResult, _Mapping]] = ..., reset: _Optional[_Union[ResetResult, _Mapping]] = ..., list_dir: _Optional[_Union[ListDirResult, _Mapping]] = ..., stat: _Optional[_Union[StatResult, _Mapping]] = ..., remove: _Optional[_Union[RemoveResult, _Mapping]] = ..., make_dir: _Optional[_Union[MakeDirResult, _Mapping]] = ..., upload: _Optional[_Union[UploadResult, _Mapping]] = ..., download: _Optional[_Union[DownloadResult, _Mapping]] = ..., list_processes: _Optional[_Union[ListProcessesResult, _Mapping]] = ..., signal: _Optional[_Union[SignalResult, _Mapping]] = ..., error: _Optional[_Union[ActionError, _Mapping]] = ...) -> None: ...

class ActionError(_message.Message):
    __slots__ = ("errno", "errno_name", "message")
    ERRNO_FIELD_NUMBER: _ClassVar[int]
    ERRNO_NAME_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    errno: int
    errno_name: str
    message: str
    def __init__(self, errno: _Optional[int] = ..., errno_name: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class ExecResult(_message.Message):
    __slots__ = ("stdout", "stderr", "exit_code", "signal", "timed_out", "stdout_truncated", "stderr_truncated", "duration_seconds", "pid", "matched", "running")
    STDOUT_FIELD_NUMBER: _ClassVar[int]
    STDERR_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    SIGNAL_FIELD_NUMBER: _ClassVar[int]
    TIMED_OUT_FIELD_NUMBER: _ClassVar[int]
    STDOUT_TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    STDERR_TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    DURATION_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    MATCHED_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    stdout: bytes
    stderr: bytes
    exit_code: int
    signal: int
    timed_out: bool
    stdout_truncated: bool
    stderr_truncated: bool
    duration_seconds: float
    pid: int
    matched: str
    running: bool
    def __init__(self, stdout: _Optional[bytes] = ..., stderr: _Optional[bytes] = ..., exit_code: _Optional[int] = ..., signal: _Optional[int] = ..., timed_out: _Optional[bool] = ..., stdout_truncated: _Optional[bool] = ..., stderr_truncated: _Optional[bool] = ..., duration_seconds: _Optional[float] = ..., pid: _Optional[int] = ..., matched: _Optional[str] = ..., running: _Optional[bool] = ...) -> None: ...

class WriteFileResult(_message.Message):
    __slots__ = ("size",)
    SIZE_FIELD_NUMBER: _ClassVar[int]
    size: int
    def __init__(self, size: _Optional[int] = ...) -> None: ...

class ReadFileResult(_message.Message):
    __slots__ = ("content", "size", "truncated")
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    content: bytes
    size: int
    truncated: bool
    def __init__(self, content: _Optional[bytes] = ..., size: _Optional[int] = ..., truncated: _Optional[bool] = ...) -> None: ...

class SubmitResult(_message.Message):
    __slots__ = ("components", "output")
    class ComponentsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    COMPONENTS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    components: _containers.ScalarMap[str, float]
    output: str
    def __init__(self, components: _Optional[_Mapping[str, float]] = ..., output: _Optional[str] = ...) -> None: ...

class ResetResult(_message.Message):
    __slots__ = ("task", "hook")
    TASK_FIELD_NUMBER: _ClassVar[int]
    HOOK_FIELD_NUMBER: _ClassVar[int]
    task: str
    hook: ExecResult
    def __init__(self, task: _Optional[str] = ..., hook: _Optional[_Union[ExecResult, _Mapping]] = ...) -> None: ...

class ListDirAction(_message.Message):
    __slots__ = ("path", "depth", "max_entries")
    PATH_FIELD_NUMBER: _ClassVar[int]
    DEPTH_FIELD_NUMBER: _ClassVar[int]
    MAX_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    path: str
    depth: int
    max_entries: int
    def __init__(self, path: _Optional[str] = ..., depth: _Optional[int] = ..., max_entries: _Optional[int] = ...) -> None: ...

class FileInfo(_message.Message):
    __slots__ = ("path", "type", "size", "mode", "modify_time_seconds", "symlink_target")
    PATH_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    MODIFY_TIME_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SYMLINK_TARGET_FIELD_NUMBER: _ClassVar[int]
    path: str
    type: FileType
    size: int
    mode: int
    modify_time_seconds: float
    symlink_target: str
    def __init__(self, path: _Optional[str] = ..., type: _Optional[_Union[FileType, str]] = ..., size: _Optional[int] = ..., mode: _Optional[int] = ..., modify_time_seconds: _Optional[float] = ..., symlink_target: _Optional[str] = ...) -> None: ...

class ListDirResult(_message.Message):
    __slots__ = ("entries", "truncated")
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[FileInfo]
    truncated: bool
    def __init__(self, entries: _Optional[_Iterable[_Union[FileInfo, _Mapping]]] = ..., truncated: _Optional[bool] = ...) -> None: ...

class StatAction(_message.Message):
    __slots__ = ("path",)
    PATH_FIELD_NUMBER: _ClassVar[int]
    path: str
    def __init__(self, path: _Optional[str] = ...) -> None: ...

class StatResult(_message.Message):
    __slots__ = ("exists", "info")
    EXISTS_FIELD_NUMBER: _ClassVar[int]
    INFO_FIELD_NUMBER: _ClassVar[int]
    exists: bool
    info: FileInfo
    def __init__(self, exists: _Optional[bool] = ..., info: _Optional[_Union[FileInfo, _Mapping]] = ...) -> None: ...

class RemoveAction(_message.Message):
    __slots__ = ("path", "recursive")
    PATH_FIELD_NUMBER: _ClassVar[int]
    RECURSIVE_FIELD_NUMBER: _ClassVar[int]
    path: str
    recursive: bool
    def __init__(self, path: _Optional[str] = ..., recursive: _Optional[bool] = ...) -> None: ...

class RemoveResult(_message.Message):
    __slots__ = ("removed",)
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    removed: int
    def __init__(self, removed: _Optional[int] = ...) -> None: ...

class MakeDirAction(_message.Message):
    __slots__ = ("path", "mode", "parents")
    PATH_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    PARENTS_FIELD_NUMBER: _ClassVar[int]
    path: str
    mode: int
    parents: bool
    def __init__(self, path: _Optional[str] = ..., mode: _Optional[int] = ..., parents: _Optional[bool] = ...) -> None: ...

class MakeDirResult(_message.Message):
    __slots__ = ("created",)
    CREATED_FIELD_NUMBER: _ClassVar[int]
    created: bool
    def __init__(self, created: _Optional[bool] = ...) -> None: ...

class UploadAction(_message.Message):
    __slots__ = ("path", "tar")
    PATH_FIELD_NUMBER: _ClassVar[int]
    TAR_FIELD_NUMBER: _ClassVar[int]
    path: str
    tar: bytes
    def __init__(self, path: _Optional[str] = ..., tar: _Optional[bytes] = ...) -> None: ...

class UploadResult(_message.Message):
    __slots__ = ("files", "bytes")
    FILES_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    files: int
    bytes: int
    def __init__(self, files: _Optional[int] = ..., bytes: _Optional[int] = ...) -> None: ...

class DownloadAction(_message.Message):
    __slots__ = ("path", "max_bytes")
    PATH_FIELD_NUMBER: _ClassVar[int]
    MAX_BYTES_FIELD_NUMBER: _ClassVar[int]
    path: str
    max_bytes: int
    def __init__(self, path: _Optional[str] = ..., max_bytes: _Optional[int] = ...) -> None: ...

class DownloadResult(_message.Message):
    __slots__ = ("tar", "files")
    TAR_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    tar: bytes
    files: int
    def __init__(self, tar: _Optional[bytes] = ..., files: _Optional[int] = ...) -> None: ...

class ListProcessesAction(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ProcessInfo(_message.Message):
    __slots__ = ("pid", "ppid", "pgid", "sid", "argv", "state", "session", "start_seconds")
    PID_FIELD_NUMBER: _ClassVar[int]
    PPID_FIELD_NUMBER: _ClassVar[int]
    PGID_FIELD_NUMBER: _ClassVar[int]
    SID_FIELD_NUMBER: _ClassVar[int]
    ARGV_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    START_SECONDS_FIELD_NUMBER: _ClassVar[int]
    pid: int
    ppid: int
    pgid: int
    sid: int
    argv: _containers.RepeatedScalarFieldContainer[str]
    state: str
    session: str
    start_seconds: float
    def __init__(self, pid: _Optional[int] = ..., ppid: _Optional[int] = ..., pgid: _Optional[int] = ..., sid: _Optional[int] = ..., argv: _Optional[_Iterable[str]] = ..., state: _Optional[str] = ..., session: _Optional[str] = ..., start_seconds: _Optional[float] = ...) -> None: ...

class ListProcessesResult(_message.Message):
    __slots__ = ("processes",)
    PROCESSES_FIELD_NUMBER: _ClassVar[int]
    processes: _containers.RepeatedCompositeFieldContainer[ProcessInfo]
    def __init__(self, processes: _Optional[_Iterable[_Union[ProcessInfo, _Mapping]]] = ...) -> None: ...

class SignalAction(_message.Message):
    __slots__ = ("pid", "signal", "process_group")
    PID_FIELD_NUMBER: _ClassVar[int]
    SIGNAL_FIELD_NUMBER: _ClassVar[int]
    PROCESS_GROUP_FIELD_NUMBER: _ClassVar[int]
    pid: int
    signal: int
    process_group: bool
    def __init__(self, pid: _Optional[int] = ..., signal: _Optional[int] = ..., process_group: _Optional[bool] = ...) -> None: ...

class SignalResult(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
