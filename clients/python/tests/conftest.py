"""Fixtures: a real deltagym server built from this checkout, serving a
Busybox image and a small "shell" env on a free loopback port.

The server needs root, Go, the static busybox of Debian's busybox-static and
a C compiler (for bin/dg-init); the ledger needs Debian's postgresql. Tests
skip, naming what is missing, when these are absent.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

REPO = Path(__file__).resolve().parents[3]
LEASE_TTL = 4.0  # seconds; short, so that the heartbeat test sees a reap

# The test env: answer 42 in /work/answer.txt. The reset hook echoes the seed
# and the option WHO, so that resets are deterministic for a seed.
SHELL_ENV = {
    "name": "shell",
    "description": "busybox test env",
    "image": "default",
    "task": "Write 42 to /work/answer.txt, then submit.",
    "setup": ["mkdir -p /work"],
    "reset_hook": "echo \"seed=${DELTAGYM_SEED:-none} who=${WHO:-nobody}\"",
    "verifier": "if [ \"$(cat /work/answer.txt 2>/dev/null)\" = 42 ]; then "
                "echo '{\"reward\": 1, \"components\": {\"correct\": 1}}'; "
                "else echo '{\"reward\": 0, \"components\": {\"correct\": 0}}'; fi",
    "env": {"PATH": "/bin:/usr/bin", "HOME": "/root"},
    "workdir": "/work",
    "limits": {"step_timeout_seconds": 20, "output_bytes": 65536},
    "budgets": {"max_steps": 100},
    "pool_size": 2,
}


@dataclass
class Server:
    addr: str
    ledger: bool
    data: Path
    log: Path
    proc: subprocess.Popen[bytes] | None = None

    def require_ledger(self) -> None:
        if not self.ledger:
            pytest.skip("ledger off: Debian's postgresql is not installed (scripts/deps.sh postgres)")


def _free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def free_port_on(*hosts: str) -> int:
    """A port free on every one of hosts (loopback addresses), as a headless Service's pods share one."""
    for _ in range(20):
        with contextlib.ExitStack() as stack:
            first = stack.enter_context(socket.socket())
            first.bind((hosts[0], 0))
            port = first.getsockname()[1]
            try:
                for h in hosts[1:]:
                    stack.enter_context(socket.socket()).bind((h, port))
            except OSError:
                continue
            return port
    raise AssertionError(f"no port free on every one of {hosts}")


def _is_static(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            head = f.read(64)
        out = subprocess.run(["file", "-L", path], capture_output=True, text=True).stdout
    except OSError:
        return False
    return head[:4] == b"\x7fELF" and "statically linked" in out


def _busybox_rootfs(root: Path) -> None:
    for d, mode in [("bin", 0o755), ("proc", 0o555), ("dev", 0o755), ("tmp", 0o1777), ("etc", 0o755),
                    ("root", 0o700), ("run", 0o755), ("sys", 0o555), ("home", 0o755), ("usr", 0o755),
                    ("usr/bin", 0o755), ("var", 0o755), ("var/tmp", 0o1777), ("work", 0o755)]:
        p = root / d
        p.mkdir(parents=True, exist_ok=True)
        os.chmod(p, mode)
    shutil.copy2("/bin/busybox", root / "bin/busybox")
    os.chmod(root / "bin/busybox", 0o755)
    applets = subprocess.run(["/bin/busybox", "--list"], check=True, capture_output=True, text=True).stdout.split()
    for a in applets:
        if a and a != "busybox" and "/" not in a and not (root / "bin" / a).exists():
            os.symlink("busybox", root / "bin" / a)
    # Sessions run bash; Busybox's ash stands in for it.
    bash = root / "bin/bash"
    if bash.is_symlink() or bash.exists():
        bash.unlink()
    bash.write_text("#!/bin/sh\nexec /bin/busybox ash \"$@\"\n")
    os.chmod(bash, 0o755)
    (root / "etc/passwd").write_text("root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/false\n")
    (root / "etc/group").write_text("root:x:0:\nnogroup:x:65534:\n")
    (root / "etc/hostname").write_text("sandbox\n")


def _health(addr: str, timeout: float, token: str) -> bool:
    with grpc.insecure_channel(addr) as ch:
        check = ch.unary_unary("/grpc.health.v1.Health/Check",
                               request_serializer=lambda b: b, response_deserializer=lambda b: b)
        try:
            resp = check(b"", timeout=timeout, metadata=(("authorization", f"Bearer {token}"),))
        except grpc.RpcError:
            return False
    return resp == b"\x08\x01"  # HealthCheckResponse{status: SERVING}


def _missing() -> str:
    if os.geteuid() != 0:
        return "the deltagym server needs root (mounts, cgroups, namespaces)"
    if shutil.which("go") is None:
        return "go is not installed (needed to build cmd/deltagym)"
    if not _is_static("/bin/busybox"):
        return "/bin/busybox is not Debian's static busybox (scripts/deps.sh image)"
    return ""


@dataclass
class _Built:
    binary: Path
    init: str


@pytest.fixture(scope="session")
def built() -> Iterator[_Built]:
    """The server binary built from this checkout, and the sandbox init."""
    why = _missing()
    if why:
        pytest.skip(why)
    tmp = Path(tempfile.mkdtemp(prefix="deltagym-pytest-bin-"))
    binary = tmp / "deltagym"
    b = subprocess.run(["go", "build", "-o", str(binary), "./cmd/deltagym"], cwd=REPO, capture_output=True, text=True)
    if b.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        pytest.skip(f"cmd/deltagym does not build yet:\n{b.stderr[-3000:]}")
    init = os.environ.get("DELTAGYM_INIT") or str(REPO / "bin/dg-init")
    if not os.path.exists(init):
        m = subprocess.run(["make", "init"], cwd=REPO, capture_output=True, text=True)
        if m.returncode != 0:
            shutil.rmtree(tmp, ignore_errors=True)
            pytest.skip(f"cannot build bin/dg-init with `make init`:\n{m.stdout[-1500:]}{m.stderr[-1500:]}")
    yield _Built(binary=binary, init=init)
    shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def _serve(built: _Built, envs: dict, extra: list, ledger: bool, host: str = "127.0.0.1",
           port: int = 0) -> Iterator[Server]:
    """Runs `deltagym serve` on host at port (default a free one) with a fresh data dir
    holding the Busybox image as "default" and a catalog of envs; stops it by its PID."""
    tmp = Path(tempfile.mkdtemp(prefix="deltagym-pytest-"))
    data = tmp / "data"
    _busybox_rootfs(data / "images/default/rootfs")
    catalog = tmp / "envs"
    catalog.mkdir()
    for name, spec in envs.items():
        (catalog / f"{name}.json").write_text(json.dumps(spec, indent=1))
    addr = f"{host}:{port or _free_port(host)}"
    log = tmp / "server.log"
    args = [str(built.binary), "serve", "--addr", addr, "--data", str(data), "--envs", str(catalog),
            "--init", built.init, "--lease-ttl", f"{LEASE_TTL}s", *extra]
    if not ledger:
        args.append("--no-ledger")
    env = {k: v for k, v in os.environ.items() if k not in ("DELTAGYM_TOKEN", "DELTAGYM_DATABASE_URL")}
    token = next((extra[i + 1] for i, a in enumerate(extra[:-1]) if a == "--token"), None)
    with open(log, "wb") as lf:
        proc = subprocess.Popen(args, stdout=lf, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        # Without --token the server writes its token to data/token before it listens.
        while not _health(addr, 1.0, token or _read(data / "token")):
            if proc.poll() is not None:
                pytest.fail(f"deltagym serve exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
            if time.monotonic() > deadline:
                pytest.fail(f"deltagym serve not healthy after 120s:\n{log.read_text()[-4000:]}")
            time.sleep(0.1)
        yield Server(addr=addr, ledger=ledger, data=data, log=log, proc=proc)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        _cleanup(tmp)


def _read(p: Path) -> str:
    try:
        return p.read_text().strip()
    except OSError:
        return ""


@pytest.fixture(scope="session")
def server(built: _Built) -> Iterator[Server]:
    """The main test server: env "shell", ledger on when postgresql is
    installed, and the token it generated, which clients find through
    $DELTAGYM_TOKEN_FILE."""
    ledger = bool(glob.glob("/usr/lib/postgresql/*/bin/postgres"))
    with _serve(built, {"shell": SHELL_ENV}, [], ledger) as s:
        old = os.environ.get("DELTAGYM_TOKEN_FILE")
        os.environ["DELTAGYM_TOKEN_FILE"] = str(s.data / "token")
        try:
            _wait_warm(s.addr)
            yield s
        finally:
            if old is None:
                os.environ.pop("DELTAGYM_TOKEN_FILE", None)
            else:
                os.environ["DELTAGYM_TOKEN_FILE"] = old


TOKEN = "py-test-token"


@pytest.fixture(scope="module")
def token_server(built: _Built) -> Iterator[Server]:
    """A server requiring the bearer token TOKEN (empty catalog, no ledger),
    for the tests of one module; never while the main server runs."""
    with _serve(built, {}, ["--token", TOKEN], False) as s:
        yield s


def _cleanup(tmp: Path) -> None:
    """Unmounts what the server left mounted below tmp, then removes tmp."""
    prefix = str(tmp) + "/"
    with open("/proc/self/mountinfo") as f:
        points = [line.split()[4] for line in f]
    for p in sorted((p for p in points if p.startswith(prefix)), key=len, reverse=True):
        subprocess.run(["umount", "-l", p], capture_output=True)
    shutil.rmtree(tmp, ignore_errors=True)


def _wait_warm(addr: str) -> None:
    """Waits until the shell env's pool has a warm sandbox."""
    from deltagym import Client

    with Client(addr, heartbeat=False) as c:
        deadline = time.monotonic() + 120
        while True:
            envs = {e.spec.name: e for e in c.list_envs()}
            if "shell" in envs and envs["shell"].warm_count > 0:
                return
            if time.monotonic() > deadline:
                pytest.fail(f"env shell not warm after 120s: {envs}")
            time.sleep(0.1)


@pytest.fixture
def client(server: Server):
    from deltagym import Client

    with Client(server.addr) as c:
        yield c
