"""Builders of the Action messages that Step takes.

    from deltagym import actions
    sb.step(actions.command("ls -l", session="main"))
    sb.step(actions.write_file("answer.txt", "42\\n"))
    sb.step(actions.submit())
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from ._proto.deltagym.v1 import action_pb2

__all__ = ["Action", "argv", "coerce", "command", "read_file", "submit", "write_file"]

Action = action_pb2.Action


def command(
    cmd: str,
    *,
    session: str = "",
    stdin: bytes | str = b"",
    env: Mapping[str, str] | None = None,
    cwd: str = "",
    timeout: float = 0.0,
    background: bool = False,
) -> action_pb2.Action:
    """Runs cmd as `/bin/sh -c cmd`, or in the persistent bash session `session`."""
    return action_pb2.Action(exec=action_pb2.ExecAction(
        command=cmd, session=session, stdin=_bytes(stdin), env=dict(env or {}), cwd=cwd,
        timeout_seconds=timeout, background=background))


def argv(
    args: Iterable[str],
    *,
    stdin: bytes | str = b"",
    env: Mapping[str, str] | None = None,
    cwd: str = "",
    timeout: float = 0.0,
    background: bool = False,
) -> action_pb2.Action:
    """Executes a program directly, without a shell."""
    return action_pb2.Action(exec=action_pb2.ExecAction(
        argv=list(args), stdin=_bytes(stdin), env=dict(env or {}), cwd=cwd,
        timeout_seconds=timeout, background=background))


def write_file(path: str, content: bytes | str, *, mode: int = 0, append: bool = False) -> action_pb2.Action:
    """Creates, replaces or (with append) extends a file inside the sandbox."""
    return action_pb2.Action(write_file=action_pb2.WriteFileAction(
        path=path, content=_bytes(content), mode=mode, append=append))


def read_file(path: str, *, offset: int = 0, max_bytes: int = 0) -> action_pb2.Action:
    """Reads (part of) a file inside the sandbox."""
    return action_pb2.Action(read_file=action_pb2.ReadFileAction(path=path, offset=offset, max_bytes=max_bytes))


def submit(answer: str | None = None) -> action_pb2.Action:
    """Ends the episode; the env's verifier runs and its reward is returned."""
    if answer is None:
        return action_pb2.Action(submit=action_pb2.SubmitAction())
    return action_pb2.Action(submit=action_pb2.SubmitAction(answer=answer))


def coerce(action: action_pb2.Action | str) -> action_pb2.Action:
    """Returns action itself, or, for a string, a shell command action."""
    if isinstance(action, action_pb2.Action):
        return action
    if isinstance(action, str):
        return command(action)
    raise TypeError(f"action must be an Action or a str, not {type(action).__name__}")


def _bytes(v: bytes | str) -> bytes:
    return v.encode() if isinstance(v, str) else bytes(v)
