"""The Python SDK's own cost per step over the generated stub (make python-bench).

Each variant times --steps rounds of one tiny command (`true`, as argv) three ways on one gRPC
channel: through the raw generated stub (EnvServiceStub.Step with a hand-built StepRequest), the
low-level Client.step, and the SDK's face, Sandbox.run (which also turns the response into a
CommandResult). Each round calls each once, starting one path later than the round before, so
that the machine's drift and any order effect fall on all alike; a path's overhead is its time
minus the raw stub's in the same round.

- server: a real deltagym server, started here (--serve bin/deltagym, with --init and
  --image-dir: a private data dir, free loopback port, no ledger; stopped by its PID at the end)
  or already running (--addr, --token). A real sandbox runs each command.
- inprocess: a trivial EnvService servicer in this process that answers every Step with the same
  response: no sandbox, no server work, so the difference is the client's cost alone.

Prints p50 and p99 (nearest rank) of each path and of each difference, in microseconds, of the wall
time and of the calling thread's CPU time, with the machine's load average before and after.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.timestamp_pb2 import Timestamp

import deltagym
from deltagym._common import CHANNEL_OPTIONS, resolve_token
from deltagym._proto.deltagym.v1 import action_pb2, env_service_pb2 as es, env_service_pb2_grpc as es_grpc

ARGV = ["true"]
PATHS = ("raw stub", "Client.step", "Sandbox.run")
ENV = {
    "name": "bench",
    "description": "the Python SDK overhead benchmark: one warm sandbox, no budgets",
    "image": "default",
    "env": {"PATH": "/usr/local/bin:/usr/bin:/bin"},
    "workdir": "/",
    "limits": {"step_timeout_seconds": 30},
    "pool_size": 1,
}


@dataclass
class Result:
    """Per path (PATHS), each timed call's wall time and the calling thread's CPU time, in ns."""

    variant: str
    wall: list[list[int]]
    cpu: list[list[int]]

    def rows(self) -> list[tuple[str, list[int], list[int]]]:
        def over_raw(xs: list[list[int]], k: int) -> list[int]:
            return [x - r for x, r in zip(xs[k], xs[0], strict=True)]

        rows = [(name, self.wall[k], self.cpu[k]) for k, name in enumerate(PATHS)]
        return rows + [(f"{PATHS[k]} - raw", over_raw(self.wall, k), over_raw(self.cpu, k)) for k in (1, 2)]


def percentile(xs: list[int], p: float) -> int:
    """Nearest rank."""
    s = sorted(xs)
    return s[max(0, math.ceil(p / 100 * len(s)) - 1)]


def interleave(paths: list[Callable[[], object]], steps: int, warmup: int) -> tuple[list[list[int]], list[list[int]]]:
    """Times steps rounds of one call of each path, after warmup untimed rounds; each round starts
    one path later than the one before, so that every path takes every place in turn. Returns the
    wall times and the calling thread's CPU times (the gRPC client's work on a synchronous call is
    done on it), which another process's load barely moves."""
    for _ in range(warmup):
        for p in paths:
            p()
    wall: list[list[int]] = [[] for _ in paths]
    cpu: list[list[int]] = [[] for _ in paths]
    clock, cpu_clock = time.perf_counter_ns, time.thread_time_ns
    n = len(paths)
    for i in range(steps):
        for k in range(n):
            j = (i + k) % n
            c0, t0 = cpu_clock(), clock()
            paths[j]()
            t1, c1 = clock(), cpu_clock()
            wall[j].append(t1 - t0)
            cpu[j].append(c1 - c0)
    return wall, cpu


def open_sandbox(client: deltagym.Client, env: str) -> Any:
    """The SDK's sandbox on client (which it does not close): Sandbox.create, or in an SDK
    without it, the handle that Client.reset returns."""
    create = getattr(deltagym.Sandbox, "create", None)
    if create is None:
        return client.reset(env)
    return create(env, client=client)


def measure(variant: str, addr: str, token: str, env: str, steps: int, warmup: int) -> Result:
    """The three paths on one channel to addr (with the SDK's options), against a sandbox of env."""
    md = (("authorization", f"Bearer {token}"),) if token else ()
    action = action_pb2.Action(exec=action_pb2.ExecAction(argv=ARGV))
    with grpc.insecure_channel(addr, options=CHANNEL_OPTIONS) as ch, \
            deltagym.Client(addr, token=token, channel=ch) as client, open_sandbox(client, env) as sb:
        stub = es_grpc.EnvServiceStub(ch)
        req = es.StepRequest(sandbox_id=sb.id, action=action)

        def raw_step() -> object:
            resp = stub.Step(req, metadata=md)
            if resp.observation.exec.exit_code != 0:
                raise RuntimeError(f"raw step: {resp}")
            return resp

        def client_step() -> object:
            return client.step(sb.id, action)

        def sandbox_run() -> object:
            return sb.run(ARGV)

        wall, cpu = interleave([raw_step, client_step, sandbox_run], steps, warmup)
    return Result(variant, wall, cpu)


class TrivialEnv(es_grpc.EnvServiceServicer):  # type: ignore[misc]  # the generated gRPC module is untyped
    """Answers Reset, Step, Heartbeat and Close at once with fixed responses."""

    def __init__(self) -> None:
        self.step_response = es.StepResponse(
            observation=action_pb2.Observation(exec=action_pb2.ExecResult(exit_code=0, duration_seconds=0.001)),
            episode_id="ep-bench", step_index=1)

    def _lease(self) -> Timestamp:
        ts = Timestamp()
        ts.FromSeconds(int(time.time()) + 3600)
        return ts

    def Reset(self, request: Any, context: Any) -> Any:
        return es.ResetResponse(sandbox_id="sb-bench", episode_id="ep-bench", checkpoint_id="ck-bench",
                                lease_expire_time=self._lease())

    def Step(self, request: Any, context: Any) -> Any:
        return self.step_response

    def Heartbeat(self, request: Any, context: Any) -> Any:
        return es.HeartbeatResponse(
            leases=[es.Lease(sandbox_id=i, expire_time=self._lease()) for i in request.sandbox_ids])

    def Close(self, request: Any, context: Any) -> Any:
        return es.CloseResponse()


@contextlib.contextmanager
def trivial_server() -> Iterator[str]:
    srv = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=CHANNEL_OPTIONS)
    es_grpc.add_EnvServiceServicer_to_server(TrivialEnv(), srv)
    port = srv.add_insecure_port("127.0.0.1:0")
    srv.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        srv.stop(grace=None).wait()


@contextlib.contextmanager
def real_server(binary: str, init: str, image_dir: str) -> Iterator[tuple[str, str]]:
    """Runs `deltagym serve` on a free loopback port with a private data dir (the default image
    linked in), the catalog ENV and no ledger; stops it by its PID (SIGINT), then removes the dir."""
    tmp = Path(tempfile.mkdtemp(prefix="deltagym-bench-"))
    data, envs = tmp / "data", tmp / "envs"
    (data / "images").mkdir(parents=True)
    (data / "images/default").symlink_to(Path(image_dir).resolve())
    envs.mkdir()
    (envs / "bench.json").write_text(json.dumps(ENV))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        addr = f"127.0.0.1:{s.getsockname()[1]}"
    log = tmp / "server.log"
    env = {k: v for k, v in os.environ.items() if k not in ("DELTAGYM_TOKEN", "DELTAGYM_DATABASE_URL")}
    with open(log, "wb") as lf:
        proc = subprocess.Popen([binary, "serve", "--addr", addr, "--data", str(data), "--envs", str(envs), "--init", init,
                                 "--no-ledger"], stdout=lf, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        token = wait_warm(addr, data / "token", proc, log)
        yield addr, token
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        remove_below(tmp)


def wait_warm(addr: str, token_file: Path, proc: subprocess.Popen[bytes], log: Path) -> str:
    """Waits until the server answers and the bench env has a warm sandbox; returns the token."""
    deadline = time.monotonic() + 300
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"deltagym serve exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
        if time.monotonic() > deadline:
            raise SystemExit(f"env bench not warm after 300 s:\n{log.read_text()[-4000:]}")
        token = token_file.read_text().strip() if token_file.exists() else ""
        if token:
            with deltagym.Client(addr, token=token, heartbeat=False, timeout=2) as c, contextlib.suppress(deltagym.DeltagymError):
                if any(e.spec.name == "bench" and e.warm_count > 0 for e in c.list_envs()):
                    return token
        time.sleep(0.2)


def remove_below(tmp: Path) -> None:
    """Unmounts what the server left mounted below tmp, deepest first, then removes tmp."""
    prefix = str(tmp) + "/"
    with open("/proc/self/mountinfo") as f:
        points = [line.split()[4] for line in f]
    for p in sorted((p for p in points if p.startswith(prefix)), key=len, reverse=True):
        subprocess.run(["umount", "-l", p], capture_output=True, check=False)
    shutil.rmtree(tmp, ignore_errors=True)


def report(results: list[Result], load: tuple[tuple[float, ...], tuple[float, ...]]) -> None:
    print(f"load average (1, 5, 15 min) before: {' '.join(f'{x:.2f}' for x in load[0])}, "
          f"after: {' '.join(f'{x:.2f}' for x in load[1])}")
    print(f"{'variant':<10} {'path':<18} {'steps':>6} {'p50 us':>9} {'p99 us':>9} {'cpu p50 us':>11} {'cpu p99 us':>11}")
    for r in results:
        for path, wall, cpu in r.rows():
            print(f"{r.variant:<10} {path:<18} {len(wall):>6} {us(wall, 50):>9.1f} {us(wall, 99):>9.1f} "
                  f"{us(cpu, 50):>11.1f} {us(cpu, 99):>11.1f}")


def us(xs: list[int], p: float) -> float:
    return percentile(xs, p) / 1e3


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variant", choices=["server", "inprocess", "both"], default="both")
    ap.add_argument("--steps", type=int, default=2000, help="timed rounds per variant (default 2000)")
    ap.add_argument("--warmup", type=int, default=200, help="untimed rounds first (default 200)")
    ap.add_argument("--addr", help="a running server (with --token or $DELTAGYM_TOKEN...), instead of --serve")
    ap.add_argument("--token", default=None, help="with --addr: the server's token (default as the SDK finds it)")
    ap.add_argument("--env", default="bench",
                    help="with --addr: the env whose sandbox runs the commands (no max_steps below the rounds' steps)")
    ap.add_argument("--serve", help="the deltagym binary to start a private server with (bin/deltagym)")
    ap.add_argument("--init", help="with --serve: the sandbox init (bin/dg-init)")
    ap.add_argument("--image-dir", help="with --serve: the built default image (.data/images/default)")
    args = ap.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        ap.error("--steps must be at least 1 and --warmup not negative")
    if args.variant != "inprocess" and not args.addr and not (args.serve and args.init and args.image_dir):
        ap.error("the server variant needs --addr, or --serve with --init and --image-dir")

    load_before = os.getloadavg()
    results = []
    if args.variant in ("inprocess", "both"):
        with trivial_server() as addr:
            results.append(measure("inprocess", addr, "", "bench", args.steps, args.warmup))
    if args.variant in ("server", "both"):
        if args.addr:
            results.append(measure("server", args.addr, resolve_token(args.token), args.env, args.steps, args.warmup))
        else:
            with real_server(args.serve, args.init, args.image_dir) as (addr, token):
                results.append(measure("server", addr, token, "bench", args.steps, args.warmup))
    report(results, (load_before, os.getloadavg()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
