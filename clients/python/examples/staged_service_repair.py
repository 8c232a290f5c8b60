"""Staged service repair: progress that lives outside git, and why a search
must return to whole states, not to code diffs.

The env (registered by this program) holds a service's repository under git
in /work/repo and its state database, SQLite, in /var/lib/svc/state.db. The
repair runs in stages, `python3 /work/repo/tools/repair.py N`, strictly in
order: stage N checks that the database recorded stage N-1 and that the
repository's config is at N-1, then migrates: it bumps the config (a change
git sees) and records the stage in the database (a change git does not
see). A stage sometimes crashes halfway, which marks the database broken:
no later stage runs. The verifier's reward is the share of stages done
(0 when broken), 1.0 once all are.

Two strategies get the same budget of stage attempts, from a scripted policy
that tries the next stage:

  git-diff restart   when a stage breaks the service, take the best state's
                     `git diff` of the repository, Reset a fresh sandbox,
                     apply the diff and go on. The diff carries the config,
                     not the database: the next stage finds the config ahead
                     of the database and refuses. It cannot finish unless
                     every stage passes in one go.
  full checkpoint    deltagym.search.GoExplore: every state reached is a
                     checkpoint of the whole sandbox, database included;
                     going back is a Restore.

Run against `make run` (the default image has python3 and git):

    python examples/staged_service_repair.py [--trials 5] [--attempts 50] [--seed 1]

It prints one line per trial and then, for example,
"git-diff restart: 0/5 solved; full checkpoint: 5/5 solved".
"""

from __future__ import annotations

import argparse
import random
import sys
from collections.abc import Callable

import deltagym
from deltagym.search import GoExplore

ENV = "staged-repair"
STAGES = 5
FAIL = 0.5  # the odds that a stage crashes halfway

REPAIR = r'''
import sqlite3, sys, random, re
DB, CONFIG = "/var/lib/svc/state.db", "/work/repo/svc/config.ini"
stage, seed = int(sys.argv[1]), int(sys.argv[2])
db = sqlite3.connect(DB)
if db.execute("select count(*) from failures").fetchone()[0]:
    sys.exit("the database holds a failed migration: the service is broken")
done = db.execute("select coalesce(max(stage), 0) from stages").fetchone()[0]
config = open(CONFIG).read()
version = int(re.search(r"schema_version = (\d+)", config).group(1))
if done != stage - 1:
    sys.exit(f"stage {stage} needs stage {stage - 1} in the database, which recorded {done}")
if version != stage - 1:
    sys.exit(f"stage {stage} needs the config at {stage - 1}; it is at {version} and the database at {done}")
if random.Random(seed).random() < FAIL:
    db.execute("insert into failures(stage) values (?)", (stage,))
    db.commit()
    sys.exit(f"stage {stage} crashed halfway")
open(CONFIG, "w").write(config.replace(f"schema_version = {version}", f"schema_version = {stage}"))
db.execute("insert into stages(stage) values (?)", (stage,))
db.commit()
print(f"stage {stage} done")
'''.replace("FAIL", repr(FAIL))

PROGRESS = r'''
import sqlite3, re
db = sqlite3.connect("/var/lib/svc/state.db")
broken = db.execute("select count(*) from failures").fetchone()[0] > 0
done = db.execute("select coalesce(max(stage), 0) from stages").fetchone()[0]
version = int(re.search(r"schema_version = (\d+)", open("/work/repo/svc/config.ini").read()).group(1))
print(done, int(broken), version)
'''

VERIFY = r'''
import json, subprocess
done, broken, version = map(int, subprocess.run(["python3", "/opt/svc/progress.py"], capture_output=True,
                                                text=True, check=True).stdout.split())
ok = not broken and done == version
print(json.dumps({"reward": done / STAGES if ok else 0.0, "components": {"stages": done, "broken": broken}}))
'''.replace("STAGES", str(STAGES))


def _file(path: str, text: str) -> str:
    return f"cat > {path} <<'DELTAGYM_EOF'\n{text.strip()}\nDELTAGYM_EOF"


SPEC = {
    "name": ENV,
    "description": "A service repository under git and its SQLite state database; a repair in stages.",
    "image": "default",
    "task": f"Run the repair's {STAGES} stages in order (python3 tools/repair.py N SEED), then submit.",
    "setup": [
        "mkdir -p /work/repo/svc /work/repo/tools /var/lib/svc /opt/svc",
        _file("/work/repo/tools/repair.py", REPAIR),
        _file("/opt/svc/progress.py", PROGRESS),
        _file("/opt/svc/verify.py", VERIFY),
        "printf '[service]\\nname = svc\\nschema_version = 0\\n' > /work/repo/svc/config.ini",
        ("python3 -c 'import sqlite3; db = sqlite3.connect(\"/var/lib/svc/state.db\"); "
         "db.execute(\"create table stages(stage integer primary key)\"); "
         "db.execute(\"create table failures(stage integer)\"); db.commit()'"),
        ("cd /work/repo && git init -q && git add -A && "
         "git -c user.name=svc -c user.email=svc@example.com commit -qm 'the service'"),
    ],
    "verifier": "python3 /opt/svc/verify.py",
    "env": {"HOME": "/root", "PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"},
    "workdir": "/work/repo",
    "limits": {"step_timeout_seconds": 60},
    "budgets": {"max_steps": 10000},
    "pool_size": 2,
}


def progress(sb: deltagym.Sandbox) -> tuple[int, bool]:
    """The stages the database recorded, and whether a crashed stage broke it."""
    done, broken, _ = map(int, sb.run(["python3", "/opt/svc/progress.py"], check=True).stdout.split())
    return done, bool(broken)


def cell(sb: deltagym.Sandbox) -> int | None:
    """The search's cell of a state: the stages done; None for a broken state, a dead end."""
    done, broken = progress(sb)
    return None if broken else done


def policy(rng: random.Random) -> Callable[[deltagym.Sandbox], list[str] | None]:
    """Tries the next stage by the database; whether it crashes is the stage's seed's, drawn from rng."""

    def explore(sb: deltagym.Sandbox) -> list[str] | None:
        done, broken = progress(sb)
        if broken or done == STAGES:
            return None
        return [f"python3 tools/repair.py {done + 1} {rng.randrange(1 << 31)}"]

    return explore


def git_diff_restart(client: deltagym.Client, attempts: int, seed: int) -> bool:
    """Attempts stages; when the service breaks, restarts a fresh sandbox from the best state's git diff."""
    explore = policy(random.Random(seed))
    best, best_diff = 0, ""
    sb = deltagym.Sandbox.create(ENV, client=client)
    try:
        for _ in range(attempts):
            if progress(sb)[1]:
                sb.close()
                sb = deltagym.Sandbox.create(ENV, client=client)
                if best_diff:
                    sb.files.write("/tmp/best.diff", best_diff)
                    sb.run("git apply /tmp/best.diff", check=True)
            for action in explore(sb) or ():
                sb.run(action)  # a refused or crashed stage is a result, not an error
            done, broken = progress(sb)
            if not broken and done > best:
                best, best_diff = done, sb.run("git diff", check=True).stdout
            if done == STAGES and not broken:
                return sb.submit().reward == 1.0
        return False
    finally:
        sb.close()


def full_checkpoint(client: deltagym.Client, attempts: int, seed: int) -> bool:
    """Go-Explore over whole-sandbox checkpoints, a stage attempt per iteration."""
    with deltagym.Sandbox.create(ENV, client=client) as sb, \
            GoExplore(sb, policy(random.Random(seed)), cell=cell, score_weight=3.0, seed=seed) as search:
        best = search.run(iterations=attempts, stop_at=1.0)
        if best.score < 1.0:
            return False
        search.restore(best)
        return sb.submit().reward == 1.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--attempts", type=int, default=50, help="stage attempts per trial, for each strategy")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--image", default="default", help="an image with python3 and git")
    args = ap.parse_args()
    with deltagym.Client() as client:
        client.register_env({**SPEC, "image": args.image}, replace=True)
        solved = {"git-diff restart": 0, "full checkpoint": 0}
        for t in range(args.trials):
            seed = args.seed * 1000 + t
            a = git_diff_restart(client, args.attempts, seed)
            b = full_checkpoint(client, args.attempts, seed)
            solved["git-diff restart"] += a
            solved["full checkpoint"] += b
            print(f"trial {t + 1}: git-diff restart {'solved' if a else 'unsolved'}, "
                  f"full checkpoint {'solved' if b else 'unsolved'}")
    print("; ".join(f"{name}: {n}/{args.trials} solved" for name, n in solved.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
