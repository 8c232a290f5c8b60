"""State digests, deduplicated checkpoints and diffs of checkpoints, through the typed SDK
against the fixture's real server; the typed diff's `git diff --stat` summary; the parity of
the sync and asyncio classes."""

from __future__ import annotations

import asyncio
import inspect
import os
import re
import subprocess
import uuid
from pathlib import Path
from typing import Any

import pytest
from google.protobuf import json_format

import deltagym
from deltagym import Client, aio, client as client_mod, sandbox as sandbox_mod, search
from deltagym._convert import checkpoint_diff
from deltagym._proto.deltagym.v1 import env_service_pb2 as es
from deltagym.types import CheckpointDiff, PathChange, ProcessChange, StateDigest


@pytest.fixture
def digests(client: Client) -> None:
    """Checks that the server serves state digests, which every test using it needs."""
    with deltagym.Sandbox.create("shell", client=client) as sb:
        ck = sb.checkpoint(wait_for_digest=True)
        try:
            assert ck.digest is not None and ck.digest.files.startswith("sha256:")
        finally:
            client.release_checkpoint(ck.id)


def test_checkpoint_without_waiting_has_no_digest(client: Client) -> None:
    with deltagym.Sandbox.create("shell", client=client) as sb:
        ck = sb.checkpoint()
        assert ck.digest is None and not ck.deduplicated
        r = sb.step("true", checkpoint=True)
        assert r.step.checkpoint_id and r.step.checkpoint_digest is None and not r.step.checkpoint_deduplicated


def test_digest_is_the_state_not_the_path(client: Client, digests: None) -> None:
    with deltagym.Sandbox.create("shell", client=client) as a, deltagym.Sandbox.create("shell", client=client) as b:
        a.files.write("/work/x", "1\n")
        a.files.write("/work/y", "2\n")
        b.run("printf '2\\n' > /work/y; printf 'draft\\n' > /work/x; rm /work/x; printf '1\\n' > /work/x")
        ca, cb = a.checkpoint(wait_for_digest=True), b.checkpoint(wait_for_digest=True)
        assert isinstance(ca.digest, StateDigest) and ca.digest.files.startswith("sha256:")
        assert ca.digest == cb.digest and ca.id != cb.id
        b.files.write("/work/y", "3\n")
        r = b.step("true", checkpoint=True, checkpoint_wait_for_digest=True)
        assert r.step.checkpoint_digest is not None and r.step.checkpoint_digest != ca.digest
        for ck in (ca.id, cb.id, r.step.checkpoint_id):
            client.release_checkpoint(ck)


def test_dedupe_answers_with_the_first_checkpoint(client: Client, digests: None) -> None:
    run = f"run-{uuid.uuid4().hex[:8]}"
    with deltagym.Sandbox.create("shell", client=client, run=run) as a, \
            deltagym.Sandbox.create("shell", client=client, run=run) as b:
        a.files.write("/work/d", "same\n")
        first = a.checkpoint(dedupe=True)
        assert first.digest is not None and not first.deduplicated
        b.run("echo same > /work/d")
        again = b.checkpoint(dedupe=True)
        assert again.deduplicated and again.id == first.id and again.digest == first.digest
        b.files.write("/work/d", "other\n")
        r = b.step("true", checkpoint=True, checkpoint_dedupe=True)
        assert not r.step.checkpoint_deduplicated and r.step.checkpoint_id != first.id
        b.files.write("/work/d", "same\n")
        r = b.step("true", checkpoint=True, checkpoint_dedupe=True)
        assert r.step.checkpoint_deduplicated and r.step.checkpoint_id == first.id
        listed = {c.checkpoint_id: c for c in client.list_checkpoints(run=run)}
        assert listed[first.id].digest.files == first.digest.files


def test_diff_checkpoints_typed(client: Client, digests: None) -> None:
    with deltagym.Sandbox.create("shell", client=client) as sb:
        sb.run("printf 'a\\nb\\nc\\n' > /work/t.txt; printf 'gone\\n' > /work/old; mkdir -p /work/m; "
               "printf '\\000\\001' > /work/bin; echo x > /work/m/f")
        base = sb.checkpoint()
        sb.run("printf 'a\\nB\\nc\\nd\\n' > /work/t.txt; rm /work/old; echo new > /work/m/n; chmod 600 /work/m/f; "
               "printf '\\000\\002\\003' > /work/bin")
        ck = sb.checkpoint()
        d = client.diff_checkpoints(base, ck, detail="unified")
        assert isinstance(d, CheckpointDiff) and d.detail == "unified" and not d.truncated
        assert d.base_checkpoint_id == base.id and d.checkpoint_id == ck.id
        assert d.base_digest is not None and d.digest is not None and d.base_digest != d.digest
        by = {p.path: p for p in d.paths}
        assert [p.path for p in d.paths] == sorted(by)
        t = by["/work/t.txt"]
        assert (t.kind, t.old_type, t.new_type, t.lines_added, t.lines_removed) == ("modified", "file", "file", 2, 1)
        assert "-b\n" in t.unified_diff and "+B\n" in t.unified_diff and "+d\n" in t.unified_diff
        assert by["/work/old"].kind == "removed" and by["/work/old"].new_type is None
        assert by["/work/m/n"].kind == "added" and by["/work/m/n"].old_type is None
        f = by["/work/m/f"]
        assert f.metadata_only and (f.old_mode & 0o777, f.new_mode & 0o777) == (0o644, 0o600)
        assert by["/work/bin"].binary and not by["/work/bin"].unified_diff
        stat = str(d)
        assert re.search(r"^ /work/t\.txt +\|   3 \+\+-$", stat, re.M), stat
        assert "| Bin 2 -> 3 bytes" in stat and re.search(r"^ /work/m/f +\|   0$", stat, re.M), stat
        assert stat.splitlines()[-1] == f" 5 files changed, {d.insertions} insertions(+), {d.deletions} deletions(-)", stat
        assert "old mode 100644\nnew mode 100600\n" in d.unified() and d.unified().count("@@") >= 2
        only = client.diff_checkpoints(base.id, ck.id, path="/work/m", max_paths=1)
        assert only.detail == "paths" and len(only.paths) == 1 and only.truncated
        assert only.paths[0].path.startswith("/work/m/") and only.paths[0].lines_added == 0
        assert client.diff_checkpoints(ck, ck).empty
        with pytest.raises(deltagym.CheckpointNotFound):
            client.diff_checkpoints(base, "ck-nope")
        for c in (base, ck):
            client.release_checkpoint(c.id)


def test_diff_refuses_bad_arguments_before_calling(client: Client) -> None:
    with pytest.raises(ValueError, match="detail"):
        client.diff_checkpoints("ck-a", "ck-b", detail="words")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_paths"):
        client.diff_checkpoints("ck-a", "ck-b", max_paths=0)
    with pytest.raises(ValueError, match="base"):
        client.diff_checkpoints("", "ck-b")
    with deltagym.Sandbox.create("shell", client=client) as sb, pytest.raises(ValueError, match="checkpoint=True"):
        sb.step("true", checkpoint_dedupe=True)
    with pytest.raises(ValueError, match="checkpoint=True"):
        client.step("sb-x", "true", checkpoint_wait_for_digest=True)


def test_async_checkpoint_digest_and_diff(server, client: Client, digests: None) -> None:
    async def main() -> None:
        async with await aio.AsyncSandbox.create("shell", addr=server.addr) as sb:
            await sb.files.write("/work/a", "1\n")
            base = await sb.checkpoint(wait_for_digest=True)
            await sb.files.write("/work/a", "2\n")
            r = await sb.step("true", checkpoint=True, checkpoint_dedupe=True)
            d = await sb.client.diff_checkpoints(base, r.step.checkpoint_id, detail="lines")
            assert base.digest is not None and r.step.checkpoint_digest not in (None, base.digest)
            assert [(p.path, p.lines_added, p.lines_removed) for p in d.paths] == [("/work/a", 1, 1)]
            await sb.client.release_checkpoint(base.id)
            await sb.client.release_checkpoint(r.step.checkpoint_id)

    asyncio.run(main())


def test_list_checkpoints_lists_what_checkpoint_took(client: Client) -> None:
    run = f"run-{uuid.uuid4().hex[:8]}"
    with deltagym.Sandbox.create("shell", client=client, run=run) as sb:
        ck = sb.checkpoint()
        listed = client.list_checkpoints(run=run)
        assert [c.checkpoint_id for c in listed] == [ck.id]
        assert listed[0].env == "shell" and listed[0].episode_id == sb.episode_id
        client.release_checkpoint(ck.id)
        assert client.list_checkpoints(run=run) == []


def test_stat_and_unified_are_the_clis(server: Any, built: Any, client: Client, digests: None) -> None:
    """stat() and unified() print what `deltagym diff` and `deltagym diff -u` print for the
    same two checkpoints: the CLI binary the fixture built, run against the same server."""
    with deltagym.Sandbox.create("shell", client=client) as sb:
        sb.run("mkdir -p /work/p && cd /work/p && printf 'one\\ntwo\\n' > b.txt && chmod 600 b.txt && "
               "printf 'x\\n' > x.sh && printf 'bye\\n' > gone && printf '\\000' > bin")
        base = sb.checkpoint()
        sb.run("cd /work/p && printf 'one\\nTWO\\nthree\\n' > b.txt && chmod 644 b.txt && chmod 755 x.sh && rm gone && "
               "mkdir d && printf 'n\\n' > d/n && ln -s b.txt link && printf '\\000\\001' > bin")
        ck = sb.checkpoint()
        env = {**os.environ, "DELTAGYM_ADDR": server.addr}

        def cli(*args: str) -> str:
            p = subprocess.run([str(built.binary), "diff", base.id, ck.id, *args], env=env, capture_output=True,
                               text=True, timeout=60)
            assert p.returncode == 0, p.stderr
            return p.stdout

        for path, max_paths in ((None, None), ("/work/p", 2)):
            lines = client.diff_checkpoints(base, ck, detail="lines", path=path, max_paths=max_paths)
            unified = client.diff_checkpoints(base, ck, detail="unified", path=path, max_paths=max_paths)
            if path:  # the CLI leaves processes out of a diff under a path; these have none
                assert not lines.processes
            args = [*(["--path", path] if path else []), *(["--max-paths", str(max_paths)] if max_paths else [])]
            assert lines.stat() + "\n" == cli(*args)
            assert unified.unified() == cli("-u", *args)
        whole = client.diff_checkpoints(base, ck, detail="lines", path="/work/p")
        assert whole.stat().splitlines()[-1] == " 6 files changed, 3 insertions(+), 2 deletions(-)", whole.stat()
        assert " /work/p/d/    |   0\n" in whole.stat() and " /work/p/link  |   0\n" in whole.stat()
        same = client.diff_checkpoints(ck, ck, detail="unified")
        assert same.stat() == same.unified() == _cli_same(built, env, ck.id) == ""
        for c in (base, ck):
            client.release_checkpoint(c.id)


def _cli_same(built: Any, env: dict[str, str], ck: str) -> str:
    """What `deltagym diff CK CK` prints."""
    p = subprocess.run([str(built.binary), "diff", ck, ck], env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    return p.stdout


TESTDATA = Path(__file__).resolve().parents[3] / "cmd/deltagym/testdata"


def test_stat_and_unified_match_the_clis_golden_texts() -> None:
    """The diff of cmd/deltagym/testdata/diff.json, every kind of change, gives the texts the
    CLI's own test holds it to (diff.stat.golden, diff.unified.golden)."""
    r = json_format.Parse((TESTDATA / "diff.json").read_text(), es.DiffCheckpointsResponse())
    d = checkpoint_diff(r, "ck-a", "ck-b", "unified")
    assert d.stat() + "\n" == (TESTDATA / "diff.stat.golden").read_text()
    assert d.unified() == (TESTDATA / "diff.unified.golden").read_text()
    assert str(d) == d.stat()


def test_stat_reads_as_git_diff_stat() -> None:
    d = CheckpointDiff(
        base_checkpoint_id="ck-a", checkpoint_id="ck-b", detail="lines",
        paths=(
            PathChange(path="/w/a.py", kind="modified", old_type="file", new_type="file", old_mode=0o644,
                       new_mode=0o755, lines_added=3, lines_removed=1),
            PathChange(path="/w/d", kind="added", new_type="dir", new_mode=0o755),
            PathChange(path="/w/gone", kind="removed", old_type="symlink", old_size=4),
            PathChange(path="/w/x", kind="modified", old_type="file", new_type="file", old_mode=0o644,
                       new_mode=0o755, metadata_only=True),
        ),
        processes=(ProcessChange(kind="modified", pid=7, command="python3 app.py", details=("cwd /a -> /b",)),),
    )
    assert str(d) == "\n".join([
        " /w/a.py | 4 +++-",
        " /w/d/   | 0",
        " /w/gone | 0",
        " /w/x    | 0",
        " 3 files changed, 3 insertions(+), 1 deletion(-)",
        "processes:",
        " ~ pid 7 python3 app.py: cwd /a -> /b",
    ])
    assert d.insertions == 3 and d.deletions == 1 and not d.empty
    one = CheckpointDiff(base_checkpoint_id="a", checkpoint_id="b", detail="paths",
                         paths=(PathChange(path="/f", kind="modified", old_type="file", new_type="file", old_size=1,
                                           new_size=2),))
    assert one.stat() == " /f\n 1 file changed"
    removed = CheckpointDiff(base_checkpoint_id="a", checkpoint_id="b", detail="lines",
                             paths=(PathChange(path="/f", kind="removed", old_type="file", lines_removed=1),))
    assert removed.stat() == " /f | 1 -\n 1 file changed, 1 deletion(-)"
    dirs = CheckpointDiff(base_checkpoint_id="a", checkpoint_id="b", detail="lines",
                          paths=(PathChange(path="/d", kind="added", new_type="dir", new_mode=0o755),))
    assert dirs.stat() == " /d/ | 0\n 0 files changed"
    assert CheckpointDiff(base_checkpoint_id="a", checkpoint_id="a", detail="paths").stat() == ""
    assert CheckpointDiff(base_checkpoint_id="a", checkpoint_id="a", detail="paths").empty


# The classes whose sync and asyncio forms offer the same methods with the same parameters,
# and the names only one form has, with why.
PAIRS = [
    (deltagym.Client, aio.AsyncClient, set()),
    (client_mod.SandboxHandle, aio.AsyncSandboxHandle, {"heartbeat_interval"}),  # a thread's, not a task's
    (deltagym.Sandbox, aio.AsyncSandbox, set()),
    (sandbox_mod.Files, aio.AsyncFiles, set()),
    (sandbox_mod.Processes, aio.AsyncProcesses, set()),
    (deltagym.Cluster, aio.AsyncCluster, {"start"}),  # the async one starts its refresher in a loop
    (search.GoExplore, search.AsyncGoExplore, set()),
]


@pytest.mark.parametrize(("sync", "async_", "apart"), PAIRS, ids=[p[0].__name__ for p in PAIRS])
def test_sync_and_async_classes_match(sync: type, async_: type, apart: set[str]) -> None:
    def methods(cls: type) -> dict[str, inspect.Signature]:
        return {n: inspect.signature(m) for n, m in inspect.getmembers(cls, callable)
                if not n.startswith("_") and n not in apart}

    s, a = methods(sync), methods(async_)
    assert sorted(s) == sorted(a)
    for name in s:
        assert list(s[name].parameters) == list(a[name].parameters), name
