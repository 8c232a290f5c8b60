from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Action(_message.Message):
    __slots__ = ("exec", "write_file", "read_file", "submit")
    EXEC_FIELD_NUMBER: _ClassVar[int]
    WRITE_FILE_FIELD_NUMBER: _ClassVar[int]
    READ_FILE_FIELD_NUMBER: _ClassVar[int]
    SUBMIT_FIELD_NUMBER: _ClassVar[int]
    exec: ExecAction
    write_file: WriteFileAction
    read_file: ReadFileAction
    submit: SubmitAction
    def __init__(self, exec: _Optional[_Union[ExecAction, _Mapping]] = ..., write_file: _Optional[_Union[WriteFileAction, _Mapping]] = ..., read_file: _Optional[_Union[ReadFileAction, _Mapping]] = ..., submit: _Optional[_Union[SubmitAction, _Mapping]] = ...) -> None: ...

class ExecAction(_message.Message):
    __slots__ = ("command", "argv", "stdin", "env", "cwd", "timeout_seconds", "background", "session")
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
    command: str
    argv: _containers.RepeatedScalarFieldContainer[str]
    stdin: bytes
    env: _containers.ScalarMap[str, str]
    cwd: str
    timeout_seconds: float
    background: bool
    session: str
    def __init__(self, command: _Optional[str] = ..., argv: _Optional[_Iterable[str]] = ..., stdin: _Optional[bytes] = ..., env: _Optional[_Mapping[str, str]] = ..., cwd: _Optional[str] = ..., timeout_seconds: _Optional[float] = ..., background: _Optional[bool] = ..., session: _Optional[str] = ...) -> None: ...

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
    __slots__ = ("exec", "write_file", "read_file", "submit", "reset", "error")
    EXEC_FIELD_NUMBER: _ClassVar[int]
    WRITE_FILE_FIELD_NUMBER: _ClassVar[int]
    READ_FILE_FIELD_NUMBER: _ClassVar[int]
    SUBMIT_FIELD_NUMBER: _ClassVar[int]
    RESET_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    exec: ExecResult
    write_file: WriteFileResult
    read_file: ReadFileResult
    submit: SubmitResult
    reset: ResetResult
    error: ActionError
    def __init__(self, exec: _Optional[_Union[ExecResult, _Mapping]] = ..., write_file: _Optional[_Union[WriteFileResult, _Mapping]] = ..., read_file: _Optional[_Union[ReadFileResult, _Mapping]] = ..., submit: _Optional[_Union[SubmitResult, _Mapping]] = ..., reset: _Optional[_Union[ResetResult, _Mapping]] = ..., error: _Optional[_Union[ActionError, _Mapping]] = ...) -> None: ...

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
    __slots__ = ("stdout", "stderr", "exit_code", "signal", "timed_out", "stdout_truncated", "stderr_truncated", "duration_seconds", "pid")
    STDOUT_FIELD_NUMBER: _ClassVar[int]
    STDERR_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    SIGNAL_FIELD_NUMBER: _ClassVar[int]
    TIMED_OUT_FIELD_NUMBER: _ClassVar[int]
    STDOUT_TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    STDERR_TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    DURATION_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    stdout: bytes
    stderr: bytes
    exit_code: int
    signal: int
    timed_out: bool
    stdout_truncated: bool
    stderr_truncated: bool
    duration_seconds: float
    pid: int
    def __init__(self, stdout: _Optional[bytes] = ..., stderr: _Optional[bytes] = ..., exit_code: _Optional[int] = ..., signal: _Optional[int] = ..., timed_out: _Optional[bool] = ..., stdout_truncated: _Optional[bool] = ..., stderr_truncated: _Optional[bool] = ..., duration_seconds: _Optional[float] = ..., pid: _Optional[int] = ...) -> None: ...

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
