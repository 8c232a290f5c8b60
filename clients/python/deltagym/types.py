"""The typed results of the Sandbox API: frozen dataclasses, no generated
message types. They are made from the server's responses in one place
(deltagym._convert); deltagym.raw holds the messages themselves."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

__all__ = [
    "ActionErrorInfo",
    "ChangeKind",
    "Checkpoint",
    "CheckpointDiff",
    "CommandResult",
    "DiffDetail",
    "Evaluation",
    "FileInfo",
    "FileType",
    "InfoValue",
    "NodeInfo",
    "OutputChunk",
    "PathChange",
    "ProcessCapture",
    "ProcessChange",
    "ProcessInfo",
    "Restored",
    "SandboxInfo",
    "StateDigest",
    "StepInfo",
    "StepResult",
    "SubmitResult",
    "UploadResult",
]

InfoValue = str | int | float | bool
"""A value of StepInfo.info: the server's text, parsed when it is a number or a boolean."""

FileType = Literal["file", "dir", "symlink", "other"]
"""The type of a path inside a sandbox (of the link itself for a symbolic link)."""

ChangeKind = Literal["added", "removed", "modified"]
"""How a path or a process differs between two checkpoints (CheckpointDiff)."""

DiffDetail = Literal["paths", "lines", "unified"]
"""How much a CheckpointDiff says of each changed file: paths, types, sizes and modes; with
"lines" also the lines added and removed in each text file; with "unified" also its unified diff."""


@dataclass(frozen=True, slots=True)
class StateDigest:
    """What identifies the state a checkpoint holds: two checkpoints with
    equal digests hold the same state, however they were reached. Frozen
    and hashable, so it can key a dict (deltagym.search's archive does).

    Attributes:
        files: the digest of its filesystem ("sha256:" and 64 hex digits): every
            path's type, permission bits, owner, content, link target and extended
            attributes; not times, not inode numbers.
        processes: the digest of its live processes ("sha256:..."), "" when it holds none.
    """

    files: str
    processes: str = ""

    def __str__(self) -> str:
        short = self.files.removeprefix("sha256:")[:12]
        if self.processes:
            return f"files {short} processes {self.processes.removeprefix('sha256:')[:12]}"
        return f"files {short}"


@dataclass(frozen=True, slots=True)
class StepInfo:
    """What the episode says about one step.

    Attributes:
        index: the step's index in its episode (inherited steps count).
        episode_id: the episode the step belongs to.
        reward: the step's reward (the verifier's, on submit).
        terminated: the episode ended (submit).
        truncated: a budget ended the episode.
        truncated_by: "max_steps" or "max_seconds" when truncated, else "".
        checkpoint_id: the checkpoint taken after the step, when asked for.
        steps_left: agent steps the episode's max_steps allows after this one; -1 without a budget.
        setup: the step was a setup step (counted against no budget).
        info: the server's extra facts, numbers and booleans parsed.
        checkpoint_digest: checkpoint_id's state digest, when the step asked to wait
            for it (checkpoint_wait_for_digest or checkpoint_dedupe), else None.
        checkpoint_deduplicated: checkpoint_dedupe found the state in an existing
            checkpoint, which checkpoint_id is.
    """

    index: int
    episode_id: str
    reward: float
    terminated: bool
    truncated: bool
    truncated_by: str
    checkpoint_id: str
    steps_left: int
    setup: bool
    info: Mapping[str, InfoValue] = field(default_factory=dict)
    checkpoint_digest: StateDigest | None = None
    checkpoint_deduplicated: bool = False


@dataclass(frozen=True, slots=True)
class CommandResult:
    """The outcome of a command.

    Attributes:
        stdout: standard output decoded as UTF-8 (bad bytes replaced).
        stderr: standard error decoded as UTF-8 (bad bytes replaced).
        stdout_bytes: standard output as sent.
        stderr_bytes: standard error as sent.
        exit_code: the exit status; -1 when killed by a signal or still running.
        signal: the signal that killed the command, or 0.
        timed_out: the command's timeout killed it.
        truncated: either stream was cut at the env's output cap.
        duration: seconds from start to exit, measured by the server.
        pid: the pid inside the sandbox of a background process, else 0.
        matched: the expect pattern that ended an interactive step's wait, else "".
        running: an interactive command is still attached to its session.
        step: the step's StepInfo.
    """

    stdout: str
    stderr: str
    stdout_bytes: bytes
    stderr_bytes: bytes
    exit_code: int
    signal: int
    timed_out: bool
    truncated: bool
    duration: float
    pid: int
    matched: str
    running: bool
    step: StepInfo

    @property
    def ok(self) -> bool:
        """Whether the command exited with status 0, in time and not by a signal."""
        return self.exit_code == 0 and not self.timed_out and self.signal == 0


@dataclass(frozen=True, slots=True)
class OutputChunk:
    """A piece of a command's output, as the server read it.

    Attributes:
        stream: "stdout" or "stderr".
        data: the bytes.
        text: the bytes decoded as UTF-8; a character split across chunks is
            decoded whole in the chunk that completes it.
    """

    stream: Literal["stdout", "stderr"]
    data: bytes
    text: str


@dataclass(frozen=True, slots=True)
class ActionErrorInfo:
    """Why an action failed because of the sandbox's own state (a missing
    file, a program that is not executable ...).

    Attributes:
        errno: the Linux error number, such as 2.
        errno_name: its name, such as "ENOENT".
        message: what failed and where.
    """

    errno: int
    errno_name: str
    message: str


@dataclass(frozen=True, slots=True)
class StepResult:
    """The outcome of a raw action (Sandbox.step).

    Attributes:
        step: the step's StepInfo.
        kind: the observation's kind ("exec", "read_file", "submit", ...), "" for an error.
        text: the observation rendered as the text an agent reads.
        command: the command's result, for an exec action.
        error: why the action failed in the sandbox, when it did.
    """

    step: StepInfo
    kind: str
    text: str
    command: CommandResult | None = None
    error: ActionErrorInfo | None = None


@dataclass(frozen=True, slots=True)
class FileInfo:
    """One path inside a sandbox.

    Attributes:
        path: relative to the listed directory (files.list), or as asked (files.stat).
        type: "file", "dir", "symlink" or "other".
        size: size in bytes.
        mode: permission bits (with setuid, setgid and sticky).
        mtime: modification time, seconds since the Unix epoch.
        symlink_target: a symbolic link's target, else "".
    """

    path: str
    type: FileType
    size: int
    mode: int
    mtime: float
    symlink_target: str


@dataclass(frozen=True, slots=True)
class UploadResult:
    """What an upload unpacked.

    Attributes:
        files: entries unpacked.
        size: bytes of file contents written.
    """

    files: int
    size: int


@dataclass(frozen=True, slots=True)
class ProcessInfo:
    """A process running in a sandbox.

    Attributes:
        pid: its pid inside the sandbox.
        ppid: its parent's pid.
        pgid: its process group.
        sid: its session id.
        argv: its command line.
        state: its state letter as in /proc (R, S, D, Z, T ...).
        session: the persistent session it runs in, else "".
        started_ago: seconds since it started.
    """

    pid: int
    ppid: int
    pgid: int
    sid: int
    argv: tuple[str, ...]
    state: str
    session: str
    started_ago: float


@dataclass(frozen=True, slots=True)
class SubmitResult:
    """The verifier's verdict on a submit.

    Attributes:
        reward: the reward.
        components: named parts of the reward.
        output: the verifier's output.
        step: the submit step's StepInfo.
    """

    reward: float
    components: Mapping[str, float]
    output: str
    step: StepInfo


@dataclass(frozen=True, slots=True)
class Evaluation:
    """The verifier's verdict on the sandbox's state, which it leaves as it was.

    Attributes:
        reward: the reward.
        components: named parts of the reward.
        output: the verifier's output.
        duration: seconds the verifier took.
    """

    reward: float
    components: Mapping[str, float]
    output: str
    duration: float


@dataclass(frozen=True, slots=True)
class ProcessCapture:
    """How a checkpoint captured one live process.

    Attributes:
        pid: its pid inside the sandbox.
        command: its command line, for display.
        method: "none", "template" or "criu".
        reason: why the method is not the one asked for, when it is not.
        saved: it has a CRIU image that restores anywhere.
        unsaved_reason: why it is not saved, when it is not.
    """

    pid: int
    command: str
    method: str
    reason: str
    saved: bool
    unsaved_reason: str


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """An immutable checkpoint of a sandbox's whole state.

    Attributes:
        id: the checkpoint ID (what restore and fork_from take).
        parent_id: the checkpoint it descends from.
        depth: delta layers its files stack on the image.
        processes: how each live process was captured.
        durable: every process is saved, so nothing that happens to the sandbox can take them.
        not_durable: the reasons of the processes that are not saved.
        env: the env of the sandbox it was taken of ("" when not known), which Sandbox.fork_from's children get.
        digest: its state digest, when the checkpoint was asked to wait for it
            (wait_for_digest or dedupe), else None.
        deduplicated: dedupe found the state in an existing checkpoint: id is that
            checkpoint's, and parent_id the sandbox's previous checkpoint.
    """

    id: str
    parent_id: str = ""
    depth: int = 0
    processes: tuple[ProcessCapture, ...] = ()
    durable: bool = False
    not_durable: tuple[str, ...] = ()
    env: str = ""
    digest: StateDigest | None = None
    deduplicated: bool = False


@dataclass(frozen=True, slots=True)
class Restored:
    """Where a restore put the sandbox.

    Attributes:
        episode_id: the new episode, started at the checkpoint.
        next_step_index: the index its next step takes.
    """

    episode_id: str
    next_step_index: int


@dataclass(frozen=True, slots=True)
class SandboxInfo:
    """A sandbox as the server describes it.

    Attributes:
        id: the sandbox ID.
        env: its env's catalog name.
        episode_id: its current episode.
        run: the run it belongs to.
        group_id: the group it belongs to.
        state: "ready", "done" (the episode ended) or "closed".
        next_step_index: the index the next step takes.
        start_checkpoint_id: the checkpoint its first episode started from.
        lease_expires_at: when its lease runs out (Unix seconds), None when unknown.
        created_at: when it was leased (Unix seconds), None when unknown.
    """

    id: str
    env: str
    episode_id: str
    run: str
    group_id: str
    state: str
    next_step_index: int
    start_checkpoint_id: str
    lease_expires_at: float | None
    created_at: float | None


@dataclass(frozen=True, slots=True)
class NodeInfo:
    """A node of a cluster and its load, as it reported them (NodeService.GetNode).

    Attributes:
        name: the node's name, the NODE part of the sandbox and checkpoint IDs it makes.
        address: the host:port this client reaches it at (where it was found).
        advertise_address: the host:port the node says it is reached at ("" when it was not given one).
        version: the server's version.
        draining: the node is shutting down: it takes no new sandboxes; those it holds run on.
        sandboxes: sandboxes leased to clients.
        max_sandboxes: sandboxes the node may hold at once; 0 for no cap.
        checkpoints: checkpoints the node holds.
        cpus: the node's CPUs.
        cpu_load: runnable threads per CPU, averaged over the last minute.
        memory_available: bytes of memory the node can still give without swapping (0 when unknown).
        memory_total: the node's memory in bytes (0 when unknown).
        measured_at: when the node measured this (Unix seconds), None when unknown.
    """

    name: str
    address: str
    advertise_address: str = ""
    version: str = ""
    draining: bool = False
    sandboxes: int = 0
    max_sandboxes: int = 0
    checkpoints: int = 0
    cpus: int = 0
    cpu_load: float = 0.0
    memory_available: int = 0
    memory_total: int = 0
    measured_at: float | None = None


@dataclass(frozen=True, slots=True)
class PathChange:
    """One path that differs between two checkpoints (CheckpointDiff.paths).

    Attributes:
        path: the absolute path in the sandbox.
        kind: "added", "removed" or "modified".
        old_type: its type in the base; None when added.
        new_type: its type in the checkpoint; None when removed.
        old_size: its size in bytes in the base.
        new_size: its size in bytes in the checkpoint.
        old_mode: its permission bits in the base.
        new_mode: its permission bits in the checkpoint.
        metadata_only: a modified path kept its content (and link target) and
            changed only its mode, owner or extended attributes.
        binary: with detail "lines" or "unified", a regular file whose content on
            either side is not text or is over 64 KiB: no line counts, no unified diff.
        lines_added: lines added, for a text file (detail "lines" or "unified").
        lines_removed: lines removed, for a text file (detail "lines" or "unified").
        unified_diff: the change as a unified diff, for a text file (detail "unified").
    """

    path: str
    kind: ChangeKind
    old_type: FileType | None = None
    new_type: FileType | None = None
    old_size: int = 0
    new_size: int = 0
    old_mode: int = 0
    new_mode: int = 0
    metadata_only: bool = False
    binary: bool = False
    lines_added: int = 0
    lines_removed: int = 0
    unified_diff: str = ""


@dataclass(frozen=True, slots=True)
class ProcessChange:
    """One process that differs between two checkpoints (CheckpointDiff.processes).

    Attributes:
        kind: "added", "removed" or "modified".
        pid: its pid in the sandbox (in the checkpoint; in the base when removed).
        command: its command line, arguments joined by spaces.
        details: what changed in a modified process ("cwd /a -> /b", "memory" ...).
    """

    kind: ChangeKind
    pid: int
    command: str
    details: tuple[str, ...] = ()


# The widest a stat() bar gets, in characters (git fits its own to the terminal).
_STAT_GRAPH = 50
# The line that ends a truncated diff's stat(), or a "# " line of its unified().
_TRUNCATED = ("(more paths changed: the list and the totals cover the first {} only; "
              "--max-paths N lists up to N, 100000 at most)")
# The line that says a diff's details were cut short (details_truncated).
_DETAILS_TRUNCATED = ("(the server's budget for line counts and unified diffs ran out: some text files "
                      "have neither; --path narrows the diff)")


@dataclass(frozen=True, slots=True)
class CheckpointDiff:
    """What differs from a base checkpoint to a checkpoint
    (Client.diff_checkpoints). str() of it is stat().

    Attributes:
        base_checkpoint_id: the checkpoint compared against.
        checkpoint_id: the checkpoint compared.
        detail: the detail asked: "paths", "lines" or "unified".
        paths: the changed paths, sorted by path; a directory added or removed is
            listed with everything below it.
        processes: the processes that came, went or changed, by pid.
        truncated: there were more path changes than max_paths.
        details_truncated: the server's budgets for file details (content read, line diff
            work, unified text) ran out: some text files have no line counts and no unified diff.
        base_digest: the base's state digest, None when not computed.
        digest: the checkpoint's state digest, None when not computed.
    """

    base_checkpoint_id: str
    checkpoint_id: str
    detail: DiffDetail
    paths: tuple[PathChange, ...] = ()
    processes: tuple[ProcessChange, ...] = ()
    truncated: bool = False
    details_truncated: bool = False
    base_digest: StateDigest | None = None
    digest: StateDigest | None = None

    @property
    def empty(self) -> bool:
        """Whether the two checkpoints hold the same files and processes (as far as listed)."""
        return not self.paths and not self.processes and not self.truncated

    @property
    def insertions(self) -> int:
        """The lines added over every text file (0 unless detail is "lines" or "unified")."""
        return sum(p.lines_added for p in self.paths)

    @property
    def deletions(self) -> int:
        """The lines removed over every text file (0 unless detail is "lines" or "unified")."""
        return sum(p.lines_removed for p in self.paths)

    def unified(self) -> str:
        """The changes as a patch that `git apply` takes (its default -p1, from the sandbox's
        root), with detail "unified"; the same text as `deltagym diff -u` prints. Each regular
        file's change comes under git's header, `diff --git a/PATH b/PATH`, with its extended
        headers (`old mode`/`new mode`, `new file mode`, `deleted file mode`, modes as 100 and
        the permission bits) and its unified diff, or git's "Binary files ... differ" (which
        git apply refuses, as it does git's own). What a patch cannot carry (a directory, an
        owner or extended attribute, a symbolic link, whose target the server does not send,
        a special file) and the processes are said on lines starting with "# ", which git
        apply skips. Equal states give ""."""
        out = [_patch(p) for p in self.paths]
        if self.truncated:
            out.append("# " + _TRUNCATED.format(len(self.paths)) + "\n")
        if self.details_truncated:
            out.append("# " + _DETAILS_TRUNCATED + "\n")
        out.append(_processes_text(self.processes, "# "))
        return "".join(out)

    def stat(self) -> str:
        """A summary in `git diff --stat`'s form, the same text as `deltagym diff` prints
        (without its final newline): a line per path, the sandbox's absolute path (a
        directory's ending in "/"), with its count of changed lines and a bar of + and - (at
        most 50 marks, scaled as git scales), "Bin OLD -> NEW bytes" for a binary file, or 0
        for a change that is not of a text file's lines (a mode, a link, a directory); then
        git's summary (directories are not counted as files, symbolic links and mode changes
        are; a zero count is left out unless both are); on a truncated diff, a line saying
        that the list and the totals cover the listed paths only; then the processes that
        changed, "+", "-" or "~" and the pid. With detail "paths" (no line counts) a path's
        line is its name only and the summary its count of files. Equal states give ""."""
        lines: list[str] = []
        if self.paths:
            lines = _stat_lines(self.paths, self.detail)
        if self.truncated:
            lines.append(_TRUNCATED.format(len(self.paths)))
        if self.details_truncated:
            lines.append(_DETAILS_TRUNCATED)
        out = "".join(line + "\n" for line in lines) + _processes_text(self.processes, "")
        return out.removesuffix("\n")

    def __str__(self) -> str:
        return self.stat()


def _is_dir_change(p: PathChange) -> bool:
    """Whether p is of a directory on each side it exists on: git tracks no directories, so it
    is listed with a trailing "/" and not counted as a file."""
    return p.old_type in (None, "dir") and p.new_type in (None, "dir")


def _stat_name(p: PathChange) -> str:
    return p.path + "/" if _is_dir_change(p) and p.path != "/" else p.path


def _stat_lines(paths: tuple[PathChange, ...], detail: DiffDetail) -> list[str]:
    files = sum(1 for p in paths if not _is_dir_change(p))
    if detail == "paths":
        return [" " + _stat_name(p) for p in paths] + [f" {files} file{'' if files == 1 else 's'} changed"]
    name_width = max(len(_stat_name(p)) for p in paths)
    most = max((p.lines_added + p.lines_removed for p in paths if not p.binary), default=0)
    number_width = max(3 if any(p.binary for p in paths) else 0, len(str(most)))  # counts line up with "Bin"
    lines = []
    for p in paths:
        name = _stat_name(p).ljust(name_width)
        if p.binary:
            lines.append(f" {name} | {'Bin':>{number_width}} {p.old_size} -> {p.new_size} bytes")
            continue
        n = p.lines_added + p.lines_removed
        line = f" {name} | {n:>{number_width}}"
        if n:
            plus, minus = _stat_bar(p.lines_added, p.lines_removed, most)
            line += " " + "+" * plus + "-" * minus
        lines.append(line)
    ins = sum(p.lines_added for p in paths if not p.binary)
    dels = sum(p.lines_removed for p in paths if not p.binary)
    lines.append(_diff_summary(files, ins, dels))
    return lines


def _stat_bar(add: int, rem: int, most: int) -> tuple[int, int]:
    """A path's + and - marks, scaled as git scales them past _STAT_GRAPH: each side that has
    lines keeps at least one."""
    if most <= _STAT_GRAPH:
        return add, rem

    def linear(n: int) -> int:
        return 1 + n * (_STAT_GRAPH - 1) // most if n else 0

    total = linear(add + rem)
    if total < 2 and add and rem:
        total = 2
    if add < rem:
        add = linear(add)
        return add, total - add
    rem = linear(rem)
    return total - rem, rem


def _diff_summary(files: int, ins: int, dels: int) -> str:
    """git's summary line: " 2 files changed, 3 insertions(+), 1 deletion(-)"."""
    if not files:
        return " 0 files changed"
    s = f" {files} file{'' if files == 1 else 's'} changed"
    if ins or not dels:
        s += f", {ins} insertion{'' if ins == 1 else 's'}(+)"
    if dels or not ins:
        s += f", {dels} deletion{'' if dels == 1 else 's'}(-)"
    return s


def _short_text(s: str, n: int) -> str:
    """s's first line, cut to n characters with "…"."""
    first, nl, _ = s.partition("\n")
    if len(first) > n:
        return first[:n - 1] + "…"
    return first + "…" if nl else first


def _processes_text(procs: tuple[ProcessChange, ...], prefix: str) -> str:
    if not procs:
        return ""
    marks = {"added": "+", "removed": "-"}
    out = [f"{prefix}processes:\n"]
    for c in procs:
        what = ": " + ", ".join(c.details) if c.details else ""
        out.append(f"{prefix} {marks.get(c.kind, '~')} pid {c.pid} {_short_text(c.command, 60)}{what}\n")
    return "".join(out)


_TYPE_WORDS = {"file": "file", "dir": "directory", "symlink": "symlink"}


def _type_word(t: FileType | None) -> str:
    return _TYPE_WORDS.get(t or "", "special file")


def _typed_path(path: str, t: FileType | None) -> str:
    return path + "/" if t == "dir" and path != "/" else path


def _new_type_words(t: FileType | None, mode: int) -> str:
    if t == "symlink":
        return "symlink (its target is not in the diff)"
    return f"{_type_word(t)}, mode {mode:o}"


def _git_mode(perm: int) -> str:
    return f"100{perm & 0o777:03o}"


def _not_patched(p: PathChange) -> str:
    """What changed of a path that is a regular file on neither side."""
    if p.kind == "added":
        return "new " + _new_type_words(p.new_type, p.new_mode)
    if p.kind == "removed":
        return "deleted " + _type_word(p.old_type)
    if p.old_type != p.new_type:
        return f"{_type_word(p.old_type)} -> {_new_type_words(p.new_type, p.new_mode)}"
    parts = []
    if p.old_mode != p.new_mode:
        parts.append(f"mode {p.old_mode:o} -> {p.new_mode:o}")
    if not p.metadata_only and p.new_type == "symlink":
        parts.append("target changed (not in the diff)")
    elif not p.metadata_only:
        parts.append("content changed")
    elif not parts:
        parts.append("owner or extended attributes changed")
    return ", ".join(parts)


def _patch(p: PathChange) -> str:
    """p's part of CheckpointDiff.unified()."""
    old_file, new_file = p.old_type == "file", p.new_type == "file"
    if not old_file and not new_file:
        return f"# {_stat_name(p)}: {_not_patched(p)}\n"
    if old_file and new_file and p.metadata_only and p.old_mode == p.new_mode:
        return f"# {p.path}: owner or extended attributes changed\n"
    out = []
    if not old_file and p.old_type is not None:
        out.append(f"# {_typed_path(p.path, p.old_type)}: deleted {_type_word(p.old_type)}\n")
    out.append(f"diff --git a{p.path} b{p.path}\n")
    old_name, new_name = "a" + p.path, "b" + p.path
    if not old_file:
        old_name = "/dev/null"
        out.append(f"new file mode {_git_mode(p.new_mode)}\n")
    elif not new_file:
        new_name = "/dev/null"
        out.append(f"deleted file mode {_git_mode(p.old_mode)}\n")
    elif p.old_mode != p.new_mode:
        out.append(f"old mode {_git_mode(p.old_mode)}\nnew mode {_git_mode(p.new_mode)}\n")
    if p.binary:
        out.append(f"Binary files {old_name} and {new_name} differ\n")
    elif p.unified_diff:
        out.append(p.unified_diff if p.unified_diff.endswith("\n") else p.unified_diff + "\n")
    if not new_file and p.new_type is not None:
        out.append(f"# {_typed_path(p.path, p.new_type)}: new {_new_type_words(p.new_type, p.new_mode)}\n")
    return "".join(out)
