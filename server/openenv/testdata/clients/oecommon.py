"""Shared by the OpenEnv client programs: arguments, the deltagym action and observation shapes,
and the result line. Standard library only: each client program runs in its own venv.

The action is one flat object: `command` (a shell string) is required and may be empty only
when exactly one of write_file, read_file, submit, checkpoint, restore, evaluate is set.
`checkpoint: true` on any action returns the new checkpoint's ID. An observation carries
the action's result (exec: stdout, stderr, exit_code; read_file: content) and, in `metadata`,
sandbox_id, episode_id, checkpoint_id, terminated and truncated. The same object is the
structured result (`data`) of the MCP tools.
"""

import json
import os
import sys
import traceback
from urllib.parse import urlsplit, urlunsplit

# Where the programs write files in the sandbox.
SCRATCH = os.environ.get("OPENENV_SCRATCH", "/tmp")


class Mismatch(AssertionError):
    """The server answered something other than what the protocol says."""


def args(report=None):
    """(base_url, token) from argv (URL [TOKEN]) or OPENENV_URL / OPENENV_TOKEN; token may be None.

    base_url is the env's URL without a token prefix, e.g. http://127.0.0.1:PORT/openenv/shell.
    """
    url = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("OPENENV_URL", "")
    token = sys.argv[2] if len(sys.argv) > 2 else os.environ.get("OPENENV_TOKEN", "")
    if not url:
        sys.stderr.write("usage: %s BASE_URL [TOKEN]  (or OPENENV_URL, OPENENV_TOKEN)\n" % sys.argv[0])
        sys.exit(2)
    if report is not None:
        report.secret = token or None
    return url.rstrip("/"), (token or None)


def prefixed(url, token):
    """url with the /t/<token>/ prefix for clients that send no headers (url itself without a token)."""
    if token is None:
        return url
    parts = urlsplit(url)
    return urlunsplit(parts._replace(path="/t/%s%s" % (token, parts.path)))


def bearer(token):
    """The Authorization header for token, or None."""
    return {"Authorization": "Bearer %s" % token} if token else None


def check(cond, what, got=None):
    if not cond:
        raise Mismatch("%s (got %r)" % (what, got) if got is not None else what)


def meta(obs):
    """The deltagym metadata of an observation dict."""
    check(isinstance(obs, dict), "observation is an object", obs)
    m = obs.get("metadata")
    check(isinstance(m, dict), "observation.metadata is an object", obs)
    return m


def ids(obs):
    """(sandbox_id, episode_id) of an observation, both non-empty strings."""
    m = meta(obs)
    for k in ("sandbox_id", "episode_id"):
        check(isinstance(m.get(k), str) and m[k], "metadata.%s is a non-empty string" % k, m)
    return m["sandbox_id"], m["episode_id"]


def ongoing(result, what):
    """A StepResult of an episode that goes on: done false, neither terminated nor truncated."""
    check(result.done is False, "%s: done is false" % what, result.done)
    m = meta(result.observation)
    check(m.get("terminated") is False, "%s: metadata.terminated is false" % what, m)
    check(m.get("truncated") is False, "%s: metadata.truncated is false" % what, m)


def stdout(result, what):
    """The stdout text of an exec step, which must have exited 0."""
    obs = result.observation
    check(obs.get("exit_code") == 0, "%s: exit_code 0" % what, obs)
    out = obs.get("stdout")
    check(isinstance(out, str), "%s: stdout is text" % what, obs)
    return out


def number(x):
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def act_command(cmd, **kw):
    return dict({"command": cmd}, **kw)


def act_write(path, content):
    return {"command": "", "write_file": {"path": path, "content": content}}


def act_read(path):
    return {"command": "", "read_file": {"path": path}}


def act_checkpoint():
    return {"command": "", "checkpoint": True}


def act_restore(checkpoint_id):
    return {"command": "", "restore": checkpoint_id}


def act_evaluate():
    return {"command": "", "evaluate": True}


def expect_error(fn, code, what):
    """fn() must raise the client's RuntimeError for a server error frame with code."""
    try:
        fn()
    except RuntimeError as e:
        check("(code: %s)" % code in str(e), "%s: error code %s" % (what, code), str(e))
        return str(e)
    raise Mismatch("%s: no error, want %s" % (what, code))


class Report:
    """Collects the checks that passed and prints the one result line."""

    def __init__(self, client):
        self.client = client
        self.checks = []
        self.sandboxes = set()
        self.secret = None  # redacted from the error in the result line

    def ok(self, name):
        self.checks.append(name)

    def saw(self, obs):
        sid, _ = ids(obs)
        self.sandboxes.add(sid)
        return sid

    def run(self, main):
        """Runs main(self); prints the result line; exits 1 on any failure."""
        try:
            main(self)
        except BaseException as e:  # noqa: BLE001 — every failure is reported the same way
            if isinstance(e, SystemExit) and e.code in (0, None):
                raise
            sys.stderr.write(traceback.format_exc())
            error = "%s: %s" % (type(e).__name__, e)
            if self.secret:
                error = error.replace(self.secret, "<token>")
            self._print(False, error)
            sys.exit(1)
        self._print(True, None)

    def _print(self, ok, error):
        line = {"client": self.client, "ok": ok, "checks": self.checks,
                "sandbox_ids": sorted(self.sandboxes)}
        if error is not None:
            line["error"] = error
        sys.stdout.write(json.dumps(line, sort_keys=True) + "\n")
        sys.stdout.flush()
