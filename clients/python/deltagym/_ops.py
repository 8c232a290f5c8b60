"""Pieces shared by Sandbox and AsyncSandbox: the setup context, request
builders, deadlines and the tar packing and safe unpacking of files.upload
and files.download."""

from __future__ import annotations

import contextlib
import contextvars
import io
import os
import stat as statmod
import tarfile
from collections.abc import Iterator, Mapping, Sequence

from ._proto.deltagym.v1 import action_pb2, env_service_pb2 as es
from .errors import UnsafeArchiveError

# The sandboxes whose calls in the current context are setup steps. A
# ContextVar, so a `with sb.setup()` block marks the calls of its own thread
# or asyncio task (and of tasks it starts), never another's.
_SETUP: contextvars.ContextVar[frozenset[str]] = contextvars.ContextVar("deltagym_setup", default=frozenset())

# A command's call deadline is its timeout plus this much, so the server's
# own timeout (which kills the command and answers) fires first.
DEADLINE_MARGIN = 30.0

@contextlib.contextmanager
def setup_context(sandbox_id: str) -> Iterator[None]:
    """Marks the calls on sandbox_id in this context as setup steps."""
    tok = _SETUP.set(_SETUP.get() | {sandbox_id})
    try:
        yield
    finally:
        _SETUP.reset(tok)


def is_setup(sandbox_id: str, setup: bool | None) -> bool:
    """setup when given, else whether the current context marks sandbox_id."""
    return setup if setup is not None else sandbox_id in _SETUP.get()


def deadline(timeout: float | None, default: float | None) -> float | None:
    """The call deadline: timeout when given, else the default."""
    if timeout is not None and timeout <= 0:
        raise ValueError(f"timeout must be positive, not {timeout}")
    return timeout if timeout is not None else default


def command_deadline(timeout: float | None, default: float | None) -> float | None:
    """The call deadline of a command whose own timeout is timeout: that
    plus DEADLINE_MARGIN, else the default."""
    if timeout is None:
        return default
    if not timeout > 0:
        raise ValueError(f"timeout must be positive, not {timeout}")
    return timeout + DEADLINE_MARGIN


def _bytes(v: str | bytes) -> bytes:
    return v.encode() if isinstance(v, str) else bytes(v)


def exec_action(cmd: str | Sequence[str], *, timeout: float | None = None, cwd: str | None = None,
                env: Mapping[str, str] | None = None, stdin: str | bytes | None = None,
                session: str | None = None, background: bool = False) -> action_pb2.Action:
    """An exec action: a str runs as `/bin/sh -c cmd` (or in the session),
    a sequence as argv without a shell."""
    return action_pb2.Action(exec=_exec_fields(cmd, timeout, cwd, env, stdin, session, background))


def exec_request(sandbox_id: str, setup: bool, checkpoint: bool, cmd: str | Sequence[str], timeout: float | None,
                 cwd: str | None, env: Mapping[str, str] | None, stdin: str | bytes | None,
                 session: str | None) -> es.StepRequest:
    """The StepRequest of exec_action(cmd, ...). Built by one constructor
    from a dict of the fields set (proto3 sends no default value): no
    action message is made and then copied into the request, no field
    set one by one."""
    x = _exec_fields(cmd, timeout, cwd, env, stdin, session, False)
    return es.StepRequest(sandbox_id=sandbox_id, action={"exec": x}, checkpoint=checkpoint, setup=setup)


def _exec_fields(cmd: str | Sequence[str], timeout: float | None, cwd: str | None, env: Mapping[str, str] | None,
                 stdin: str | bytes | None, session: str | None, background: bool) -> dict[str, object]:
    """The ExecAction fields of a command that are not their default."""
    x: dict[str, object]
    if isinstance(cmd, str):
        x = {"command": cmd}
    else:
        args = list(cmd)
        for a in args:
            if not isinstance(a, str):
                raise TypeError("cmd must be a str or a sequence of str")
        x = {"argv": args}
    if stdin:
        x["stdin"] = _bytes(stdin)
    if env:
        x["env"] = dict(env)
    if cwd:
        x["cwd"] = cwd
    if timeout:
        x["timeout_seconds"] = timeout
    if background:
        x["background"] = True
    if session:
        x["session"] = session
    return x


def interactive_action(session: str, text: str, *, expect: Sequence[str] = (), timeout: float | None = None,
                       interrupt: bool = False) -> action_pb2.Action:
    """An interactive session step: text (and a newline) written to the
    program attached to the session, or starting it; with interrupt, a
    SIGINT to it (text must be empty)."""
    if isinstance(expect, str):
        raise TypeError("expect is a sequence of patterns, not one str")
    return action_pb2.Action(exec=action_pb2.ExecAction(
        command=text, session=session, interactive=True, expect=list(expect), interrupt=interrupt,
        timeout_seconds=timeout or 0.0))


def step_request(sandbox_id: str, action: action_pb2.Action, setup: bool, checkpoint: bool = False) -> es.StepRequest:
    """A StepRequest."""
    return es.StepRequest(sandbox_id=sandbox_id, action=action, checkpoint=checkpoint, setup=setup)


# --- files ---------------------------------------------------------------------------------------

def read_action(path: str, offset: int) -> action_pb2.Action:
    """A read of path from offset, as much as the env allows."""
    return action_pb2.Action(read_file=action_pb2.ReadFileAction(path=path, offset=offset))


def write_action(path: str, data: str | bytes, mode: int | None, append: bool) -> action_pb2.Action:
    """A write of data to path."""
    return action_pb2.Action(write_file=action_pb2.WriteFileAction(path=path, content=_bytes(data), mode=mode or 0,
                                                                   append=append))


def list_action(path: str, depth: int) -> action_pb2.Action:
    """A listing of path, depth levels down."""
    if depth < 0:
        raise ValueError(f"depth must be at least 0, not {depth}")
    return action_pb2.Action(list_dir=action_pb2.ListDirAction(path=path, depth=depth))


def stat_action(path: str) -> action_pb2.Action:
    """A stat of path."""
    return action_pb2.Action(stat=action_pb2.StatAction(path=path))


def remove_action(path: str, recursive: bool) -> action_pb2.Action:
    """A removal of path."""
    return action_pb2.Action(remove=action_pb2.RemoveAction(path=path, recursive=recursive))


def mkdir_action(path: str, parents: bool, mode: int | None) -> action_pb2.Action:
    """A directory creation."""
    return action_pb2.Action(make_dir=action_pb2.MakeDirAction(path=path, parents=parents, mode=mode or 0))


def upload_action(data: bytes, remote_dir: str) -> action_pb2.Action:
    """An upload of a tar archive into remote_dir."""
    return action_pb2.Action(upload=action_pb2.UploadAction(path=remote_dir, tar=bytes(data)))


def download_action(path: str) -> action_pb2.Action:
    """A download of path as a tar archive."""
    return action_pb2.Action(download=action_pb2.DownloadAction(path=path))


def list_processes_action() -> action_pb2.Action:
    """A listing of the sandbox's processes."""
    return action_pb2.Action(list_processes=action_pb2.ListProcessesAction())


def signal_action(pid: int, sig: int, group: bool) -> action_pb2.Action:
    """A signal to pid (or its process group)."""
    return action_pb2.Action(signal=action_pb2.SignalAction(pid=int(pid), signal=int(sig), process_group=group))


def pack(local_path: str | os.PathLike[str]) -> bytes:
    """A tar archive in memory of a local file or directory, its entries
    named below the path's base name (a directory "src" gives "src/...",
    as the server's downloads do). Symbolic links are kept as links."""
    p = os.fspath(local_path)
    if not os.path.lexists(p):
        raise FileNotFoundError(p)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        tf.add(p, arcname=os.path.basename(os.path.normpath(p)), recursive=True)
    return buf.getvalue()


def _member_path(name: str) -> str:
    """The member's name, normalized; UnsafeArchiveError when absolute or with a '..' part."""
    if name.startswith("/") or "\\" in name or "\x00" in name:
        raise UnsafeArchiveError(f"archive entry {name!r}: absolute or not a plain path")
    parts = [c for c in name.split("/") if c not in ("", ".")]
    if not parts or ".." in parts:
        raise UnsafeArchiveError(f"archive entry {name!r}: empty or leads up with '..'")
    return "/".join(parts)


def _resolve_link(path: str, links: Mapping[str, str]) -> None:
    """Follows the archive's own symbolic links from path the way the kernel
    would; UnsafeArchiveError when that leaves the root."""
    out: list[str] = []
    todo = path.split("/")
    hops = 0
    while todo:
        comp = todo.pop(0)
        if comp in ("", "."):
            continue
        if comp == "..":
            if not out:
                raise UnsafeArchiveError(f"archive link {path!r} leads outside the directory")
            out.pop()
            continue
        out.append(comp)
        target = links.get("/".join(out))
        if target is None:
            continue
        hops += 1
        if hops > 40 or target.startswith("/"):
            raise UnsafeArchiveError(f"archive link {path!r} is absolute or loops")
        out.pop()
        todo = target.split("/") + todo


def check_archive(tf: tarfile.TarFile) -> list[tuple[tarfile.TarInfo, str]]:
    """Checks every member of the archive before anything is written: plain
    relative paths only, files, directories and links only, no entry
    below one of the archive's symbolic links, hard links to files of the
    archive, symbolic links that stay inside by the archive's own links.
    Returns the members with their normalized paths."""
    members: list[tuple[tarfile.TarInfo, str]] = []
    links: dict[str, str] = {}
    files: set[str] = set()
    for m in tf.getmembers():
        path = _member_path(m.name)
        if not (m.isreg() or m.isdir() or m.issym() or m.islnk()):
            raise UnsafeArchiveError(f"archive entry {m.name!r}: a device, FIFO or other special file")
        if m.issym():
            links[path] = m.linkname
        elif m.islnk():
            if _member_path(m.linkname) not in files:
                raise UnsafeArchiveError(f"archive hard link {m.name!r} to {m.linkname!r}, not an earlier file of it")
        elif m.isreg():
            files.add(path)
        members.append((m, path))
    for _, path in members:
        parts = path.split("/")
        for i in range(1, len(parts)):
            if "/".join(parts[:i]) in links:
                raise UnsafeArchiveError(f"archive entry {path!r} lies below a symbolic link of the archive")
    for path in links:
        _resolve_link(path, links)
    return members


def _inside(root: str, path: str) -> bool:
    real = os.path.realpath(path)
    return real == root or real.startswith(root + os.sep)


def _open_tar(data: bytes) -> tarfile.TarFile:
    return tarfile.open(fileobj=io.BytesIO(data), mode="r:*")


def extract(data: bytes, local_dir: str | os.PathLike[str]) -> list[str]:
    """Unpacks a tar archive into local_dir (created when missing) after
    check_archive passed: directories and files first, then hard links,
    then symbolic links, so no write follows a link the archive made; a
    path whose parent resolves outside local_dir (through links already on
    disk) is refused. Permission bits keep rwx only. Returns the paths
    written, in archive order."""
    try:
        tf = _open_tar(data)
    except tarfile.TarError as e:
        raise UnsafeArchiveError(f"not a tar archive: {e}") from None
    with tf:
        members = check_archive(tf)
        os.makedirs(local_dir, exist_ok=True)
        root = os.path.realpath(local_dir)
        out: list[str] = []

        def target(path: str) -> str:
            dest = os.path.join(root, *path.split("/"))
            if not _inside(root, os.path.dirname(dest)):
                raise UnsafeArchiveError(f"{path!r} would land outside {root} through a link on disk")
            return dest

        for m, path in members:
            if m.isdir():
                dest = target(path)
                if os.path.islink(dest):
                    raise UnsafeArchiveError(f"{dest} is a symbolic link on disk")
                os.makedirs(dest, exist_ok=True)
                os.chmod(dest, (m.mode & 0o777) | statmod.S_IRWXU)
                out.append(dest)
            elif m.isreg():
                dest = target(path)
                os.makedirs(os.path.dirname(dest), exist_ok=True)
                src = tf.extractfile(m)
                if src is None:
                    raise UnsafeArchiveError(f"archive entry {path!r} has no contents")
                fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, m.mode & 0o777)
                with os.fdopen(fd, "wb") as f:
                    while chunk := src.read(1 << 20):
                        f.write(chunk)
                os.chmod(dest, m.mode & 0o777)
                out.append(dest)
        for m, path in members:
            if m.islnk():
                dest = target(path)
                os.makedirs(os.path.dirname(dest), exist_ok=True)
                if os.path.lexists(dest):
                    os.unlink(dest)
                os.link(target(_member_path(m.linkname)), dest, follow_symlinks=False)
                out.append(dest)
        for m, path in members:
            if m.issym():
                dest = target(path)
                os.makedirs(os.path.dirname(dest), exist_ok=True)
                if os.path.lexists(dest):
                    if os.path.isdir(dest) and not os.path.islink(dest):
                        raise UnsafeArchiveError(f"{dest} is a directory; the archive makes it a link")
                    os.unlink(dest)
                os.symlink(m.linkname, dest)
                out.append(dest)
    return out
