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
from collections.abc import Mapping, Sequence
from typing import IO

from ._proto.deltagym.v1 import action_pb2, env_service_pb2 as es
from .errors import UnsafeArchiveError

# The sandboxes whose calls in the current context are setup steps. A
# ContextVar, so a `with sb.setup()` block marks the calls of its own thread
# or asyncio task (and of tasks it starts), never another's.
_SETUP: contextvars.ContextVar[frozenset[str]] = contextvars.ContextVar("deltagym_setup", default=frozenset())

# A command's call deadline is its timeout plus this much, so the server's
# own timeout (which kills the command and answers) fires first.
DEADLINE_MARGIN = 30.0

class SetupContext:
    """Marks the calls on a sandbox in this context as setup steps: a
    context manager for `with` and for `async with` alike (entering it
    does no I/O, so the two are one)."""

    __slots__ = ("_id", "_tokens")

    def __init__(self, sandbox_id: str) -> None:
        self._id = sandbox_id
        self._tokens: list[contextvars.Token[frozenset[str]]] = []

    def __enter__(self) -> None:
        self._tokens.append(_SETUP.set(_SETUP.get() | {self._id}))

    def __exit__(self, *exc: object) -> None:
        _SETUP.reset(self._tokens.pop())

    async def __aenter__(self) -> None:
        self.__enter__()

    async def __aexit__(self, *exc: object) -> None:
        self.__exit__()


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


def step_request(sandbox_id: str, action: action_pb2.Action, setup: bool, checkpoint: bool = False,
                 wait_for_digest: bool = False, dedupe: bool = False) -> es.StepRequest:
    """A StepRequest; wait_for_digest and dedupe are the checkpoint's, so they need checkpoint."""
    if not (wait_for_digest or dedupe):
        return es.StepRequest(sandbox_id=sandbox_id, action=action, checkpoint=checkpoint, setup=setup)
    if not checkpoint:
        raise ValueError("checkpoint_wait_for_digest and checkpoint_dedupe need checkpoint=True")
    return es.StepRequest(sandbox_id=sandbox_id, action=action, checkpoint=True, setup=setup,
                          checkpoint_wait_for_digest=wait_for_digest, checkpoint_dedupe=dedupe)


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


def _check_link_target(path: str, target: str) -> None:
    """UnsafeArchiveError unless the symbolic link at path (normalized,
    relative to the root) has a relative target whose '..' parts all lead
    it and number at most the link's depth below the root. Such a target
    first climbs to an ancestor of the link's own directory, which is a
    real directory inside the root, then only descends; so it resolves
    inside the root whatever the names it descends through are, as long
    as every link among them obeys the same rule. The rule depends on no
    other entry, of this archive or on disk, so no later extraction can
    turn a link made by an earlier one outward."""
    if not target or target.startswith("/") or "\\" in target or "\x00" in target:
        raise UnsafeArchiveError(f"archive link {path!r} to {target!r}: empty, absolute or not a plain path")
    parts = [c for c in target.split("/") if c not in ("", ".")]
    up = 0
    while up < len(parts) and parts[up] == "..":
        up += 1
    if ".." in parts[up:]:
        raise UnsafeArchiveError(f"archive link {path!r} to {target!r}: a '..' after a name")
    if up > path.count("/"):
        raise UnsafeArchiveError(f"archive link {path!r} to {target!r} leads outside the directory")


def _check_names(members: Sequence[tuple[tarfile.TarInfo, str]]) -> None:
    """UnsafeArchiveError when two entries claim one path (except a
    directory named twice), or an entry lies below one that is not a
    directory. Names that differ only in case are one name on a
    case-insensitive file system: they conflict when one is a symbolic
    link, or one a directory and the other not; files may differ in case."""
    seen: dict[str, tarfile.TarInfo] = {}
    for m, path in members:
        prev = seen.get(path)
        if prev is not None and not (prev.isdir() and m.isdir()):
            raise UnsafeArchiveError(f"archive entry {path!r} appears twice")
        seen[path] = m
    variants: dict[str, list[str]] = {}
    nondirs: dict[str, str] = {}  # the case-folded path of each non-directory -> its path
    for path, m in seen.items():
        variants.setdefault(path.casefold(), []).append(path)
        if not m.isdir():
            nondirs.setdefault(path.casefold(), path)
    for path, m in seen.items():
        for other in variants[path.casefold()]:
            if other != path and (m.issym() or m.isdir() != seen[other].isdir()):
                raise UnsafeArchiveError(f"archive entries {path!r} and {other!r} differ only in case")
        parts = path.split("/")
        for i in range(1, len(parts)):
            above = nondirs.get("/".join(parts[:i]).casefold())
            if above is not None:
                raise UnsafeArchiveError(f"archive entry {path!r} lies below {above!r}, which is not a directory")


def check_archive(tf: tarfile.TarFile) -> list[tuple[tarfile.TarInfo, str]]:
    """Checks every member of the archive before anything is written: plain
    relative paths only; files, directories and links only; no path named
    twice (a directory may be), nor by case variants when one is a link or
    file and the other not alike; no entry below a file or link of the
    archive; hard links to earlier files of it; symbolic links by
    _check_link_target. Returns the members with their normalized paths,
    a directory named twice once."""
    members: list[tuple[tarfile.TarInfo, str]] = []
    files: set[str] = set()
    for m in tf.getmembers():
        path = _member_path(m.name)
        if not (m.isreg() or m.isdir() or m.issym() or m.islnk()):
            raise UnsafeArchiveError(f"archive entry {m.name!r}: a device, FIFO or other special file")
        if m.issym():
            _check_link_target(path, m.linkname)
        elif m.islnk():
            if _member_path(m.linkname) not in files:
                raise UnsafeArchiveError(f"archive hard link {m.name!r} to {m.linkname!r}, not an earlier file of it")
        elif m.isreg():
            files.add(path)
        members.append((m, path))
    _check_names(members)
    dirs: set[str] = set()
    unique = []
    for m, path in members:
        if m.isdir():
            if path in dirs:
                continue
            dirs.add(path)
        unique.append((m, path))
    return unique


def _check_disk(root: str, members: Sequence[tuple[tarfile.TarInfo, str]]) -> None:
    """UnsafeArchiveError when what is already in root is in the way: a
    symbolic link or file where an entry needs a directory above it, a
    directory where the archive puts a file or link, or anything but a
    directory where it puts one. Entries never land below a link on disk,
    so an entry's depth in the archive is its depth below root."""
    for m, path in members:
        parts = path.split("/")
        cur = root
        for i, comp in enumerate(parts):
            cur = os.path.join(cur, comp)
            try:
                mode = os.lstat(cur).st_mode
            except FileNotFoundError:
                break
            rel = "/".join(parts[:i + 1])
            if i < len(parts) - 1 or m.isdir():
                if statmod.S_ISLNK(mode):
                    raise UnsafeArchiveError(f"{rel!r} is a symbolic link in {root}; the archive needs a directory there")
                if not statmod.S_ISDIR(mode):
                    raise UnsafeArchiveError(f"{rel!r} is a file in {root}; the archive needs a directory there")
            elif statmod.S_ISDIR(mode):
                raise UnsafeArchiveError(f"{rel!r} is a directory in {root}; the archive puts a file or link there")


def _inside(root: str, path: str) -> bool:
    real = os.path.realpath(path)
    return real == root or real.startswith(root + os.sep)


def _open_tar(data: bytes) -> tarfile.TarFile:
    return tarfile.open(fileobj=io.BytesIO(data), mode="r:*")


def _mkdir(path: str) -> None:
    """Makes the directory path unless one is there; UnsafeArchiveError when
    anything else is, a symbolic link above all (never followed)."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(path)
    if not statmod.S_ISDIR(os.lstat(path).st_mode):
        raise UnsafeArchiveError(f"{path} is a symbolic link or file; the archive needs a directory there")


def _place(root: str, path: str) -> str:
    """The path of an entry below root, its parent directories made one by
    one, none of them a symbolic link."""
    parts = path.split("/")
    cur = root
    for comp in parts[:-1]:
        cur = os.path.join(cur, comp)
        _mkdir(cur)
    return os.path.join(cur, parts[-1])


def _unlink_nondir(dest: str) -> None:
    """Removes a file or link at dest, so what replaces it is a new inode
    and not a write through a name already there."""
    if os.path.lexists(dest):
        if os.path.isdir(dest) and not os.path.islink(dest):
            raise UnsafeArchiveError(f"{dest} is a directory; the archive puts a file or link there")
        os.unlink(dest)


def _write_dir(dest: str, mode: int) -> None:
    _mkdir(dest)
    fd = os.open(dest, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        os.fchmod(fd, (mode & 0o777) | statmod.S_IRWXU)
    finally:
        os.close(fd)


def _write_file(dest: str, src: IO[bytes], mode: int) -> None:
    _unlink_nondir(dest)
    fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as f:
        while chunk := src.read(1 << 20):
            f.write(chunk)
        os.fchmod(f.fileno(), mode & 0o777)


def extract(data: bytes, local_dir: str | os.PathLike[str]) -> list[str]:
    """Unpacks a tar archive into local_dir (created when missing) after
    check_archive and _check_disk passed, so a bad archive, or one that
    clashes with what local_dir holds, writes nothing. Directories and
    files first, then hard links, then symbolic links, so no write follows
    a link the archive made; no entry lands below a symbolic link already
    on disk; files and links replace files and links already there, never
    directories, and a file is always a new inode. Permission bits keep
    rwx only.

    Every symbolic link made has a target that climbs only to its own
    ancestors inside local_dir and then descends (see _check_link_target),
    so it stays inside whatever a later extraction adds. A link may still
    descend through a link that was in local_dir before and that this
    module did not make; the links are resolved on disk once made, and when
    one resolves outside local_dir, the links made by this call are removed
    and UnsafeArchiveError raised (the files and directories stay). Links
    already in local_dir are the caller's: none is followed to write, and
    their own targets are not checked.

    Returns the paths written, in the order written."""
    try:
        tf = _open_tar(data)
    except tarfile.TarError as e:
        raise UnsafeArchiveError(f"not a tar archive: {e}") from None
    with tf:
        members = check_archive(tf)
        os.makedirs(local_dir, exist_ok=True)
        root = os.path.realpath(local_dir)
        _check_disk(root, members)
        out: list[str] = []
        for m, path in members:
            if m.isdir():
                dest = _place(root, path)
                _write_dir(dest, m.mode)
                out.append(dest)
            elif m.isreg():
                dest = _place(root, path)
                src = tf.extractfile(m)
                if src is None:
                    raise UnsafeArchiveError(f"archive entry {path!r} has no contents")
                _write_file(dest, src, m.mode)
                out.append(dest)
        for m, path in members:
            if m.islnk():
                dest = _place(root, path)
                _unlink_nondir(dest)
                os.link(_place(root, _member_path(m.linkname)), dest, follow_symlinks=False)
                out.append(dest)
        made: list[str] = []
        for m, path in members:
            if m.issym():
                dest = _place(root, path)
                _unlink_nondir(dest)
                os.symlink(m.linkname, dest)
                made.append(dest)
                out.append(dest)
        _check_links(root, made)
    return out


def _check_links(root: str, made: Sequence[str]) -> None:
    """Removes the links made and raises UnsafeArchiveError when one of them
    resolves outside root (through a link that was already on disk)."""
    bad = next((p for p in made if not _inside(root, p)), None)
    if bad is None:
        return
    for p in made:
        if os.path.islink(p):
            os.unlink(p)
    raise UnsafeArchiveError(f"archive link {os.path.relpath(bad, root)!r} resolves outside the directory "
                             "through a link already in it; the archive's links were removed")
