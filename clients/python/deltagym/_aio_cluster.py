"""deltagym.aio.AsyncCluster: the asyncio Cluster, the same placement and routing as
deltagym.Cluster with every call a coroutine.

    from deltagym.aio import AsyncCluster, AsyncSandbox

    async with AsyncCluster("dns:deltagym-nodes.default.svc:8080") as cluster:
        async with await AsyncSandbox.create("shell", cluster=cluster) as sb:
            print((await sb.run("echo hi")).stdout)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar

import grpc
import grpc.aio

from . import _cluster as cl, _common as c
from ._proto.deltagym.v1 import env_service_pb2 as es, node_service_pb2 as ns
from .aio import AsyncClient, AsyncSandboxHandle
from .errors import DeltagymError
from .types import Checkpoint, CheckpointDiff, DiffDetail, NodeInfo

__all__ = ["AsyncCluster", "AsyncResolver"]

log = logging.getLogger("deltagym")

AsyncResolver = Callable[[str], Sequence[str] | Awaitable[Sequence[str]]]
"""A resolver of a cluster's DNS name: the name, to its IPs; a function or a coroutine function."""

# The deadline argument's default: the cluster's own timeout.
_DEFAULT: Any = object()

T = TypeVar("T")


class AsyncCluster:
    """The asyncio Cluster: arguments, placement and routing as deltagym.Cluster's, with
    every call a coroutine and the node clients AsyncClients. The first refresh happens at
    `async with`, or at the first call that needs the nodes; an asyncio task refreshes
    every `refresh` seconds until close(). Create it inside a running event loop."""

    def __init__(self, target: str, *, token: str | None = None, refresh: float = 10.0,
                 resolver: AsyncResolver | None = None, timeout: float | None = None,
                 retry: c.RetryPolicy = c.DEFAULT_RETRY, heartbeat: bool = True) -> None:
        if not refresh > 0 or refresh == float("inf"):
            raise ValueError(f"refresh must be a positive number of seconds, not {refresh}")
        self.target = target
        self._target = cl.parse_target(target)
        self.refresh_interval = float(refresh)
        self.timeout = timeout
        self.retry = retry
        self.heartbeat_enabled = heartbeat
        self._token = c.resolve_token(token)
        self._resolver = resolver
        self._members: cl.Membership[AsyncClient] = cl.Membership(target, self._make)
        self._refreshing = asyncio.Lock()  # one refresh at a time; guards _closed and _task
        self._closed = False
        self._task: asyncio.Task[None] | None = None

    def __repr__(self) -> str:
        return f"AsyncCluster({self.target!r}, nodes={[n.name for n in self.nodes()]})"

    def _make(self, addr: str) -> AsyncClient:
        return AsyncClient(addr, token=self._token, timeout=self.timeout, retry=self.retry,
                           heartbeat=self.heartbeat_enabled)

    async def start(self) -> None:
        """Refreshes once and starts the refresh task, unless started already (`async with`
        and the calls that need the nodes start the cluster)."""
        if self._task is not None:
            return
        await self.refresh()
        async with self._refreshing:
            if self._task is None and not self._closed:
                self._task = asyncio.get_running_loop().create_task(self._refresher(), name="deltagym-cluster-refresh")

    # --- discovery ----------------------------------------------------------------------------

    async def _resolve(self) -> list[str]:
        t = self._target
        if not t.dns_name:
            return list(t.static)
        try:
            if self._resolver is None:
                infos = await asyncio.get_running_loop().getaddrinfo(t.dns_name, None, type=socket.SOCK_STREAM)
                return cl.addresses(cl.ips_of(infos), t.port)
            got = self._resolver(t.dns_name)
            ips = await got if isinstance(got, Awaitable) else got
            return cl.addresses(ips, t.port)
        except Exception as e:  # a resolver's failure is no reason to forget the nodes found before
            log.warning("cluster %s: resolving %s: %s; keeping the addresses found before", self.target, t.dns_name, e)
            return self._members.addresses()

    async def _probe(self, addr: str, client: AsyncClient) -> NodeInfo | str:
        try:
            resp = await client._node_service.GetNode(ns.GetNodeRequest(), metadata=client._md, timeout=cl.PROBE_TIMEOUT)
        except grpc.aio.AioRpcError as e:
            return str(client._error(e, "GetNode"))
        return cl.report(resp.node, addr)

    async def refresh(self) -> list[NodeInfo]:
        """Resolves the target and asks every address for its node and load now; returns nodes()."""
        async with self._refreshing:
            if self._closed:
                raise ValueError("the cluster is closed")
            addrs = await self._resolve()
            plan = self._members.probe_plan(addrs)
            answers = await asyncio.gather(*(self._probe(a, client) for a, client in plan))
            close = self._members.apply(addrs, plan, {a: r for (a, _), r in zip(plan, answers, strict=True)})
        await _close_all(close)
        return self.nodes()

    async def _refresher(self) -> None:
        while True:
            await asyncio.sleep(self.refresh_interval)
            try:
                await self.refresh()
            except Exception as e:  # the next refresh tries again
                log.warning("cluster %s: refresh: %s", self.target, e)

    def nodes(self) -> list[NodeInfo]:
        """The last reports of the nodes (as Cluster.nodes); [] before the first refresh."""
        return self._members.nodes()

    def clients(self) -> dict[str, AsyncClient]:
        """The AsyncClient of each node nodes() reports, by name."""
        return self._members.clients()

    # --- routing ------------------------------------------------------------------------------

    async def client_for(self, id: str) -> AsyncClient:
        """The AsyncClient of the node a sandbox or checkpoint ID names (as Cluster.client_for)."""
        await self.start()
        kind = "checkpoint" if id.startswith("ck-") else "sandbox"
        found = self._members.route(id, kind)
        if found is None and time.monotonic() - self._members.refreshed_at >= cl.ROUTE_REFRESH:
            await self.refresh()
            found = self._members.route(id, kind)
        if found is None:
            raise self._members.unknown(id, kind)
        return found

    async def diff_checkpoints(self, base: Checkpoint | str, checkpoint: Checkpoint | str, *,
                               detail: DiffDetail = "paths", path: str | None = None, max_paths: int | None = None,
                               timeout: Any = _DEFAULT) -> CheckpointDiff:
        """As Cluster.diff_checkpoints, awaited."""
        ck = c.checkpoint_id(checkpoint)
        client = await self.client_for(ck)
        return await client.diff_checkpoints(base, ck, detail=detail, path=path, max_paths=max_paths,
                                             timeout=self.timeout if timeout is _DEFAULT else timeout)

    async def list_checkpoints(self, *, env: str = "", run: str = "", group_id: str = "", episode_id: str = "",
                               timeout: Any = _DEFAULT) -> list[es.CheckpointSummary]:
        """As Cluster.list_checkpoints, awaited (the nodes asked at once)."""
        await self.start()
        deadline = self.timeout if timeout is _DEFAULT else timeout
        parts = await asyncio.gather(*(client.list_checkpoints(env=env, run=run, group_id=group_id,
                                                               episode_id=episode_id, timeout=deadline)
                                       for client in self.clients().values()))
        return sorted((ck for part in parts for ck in part), key=lambda ck: (ck.create_time.seconds, ck.create_time.nanos))

    # --- placement ----------------------------------------------------------------------------

    async def _place(self, call: str, n: int, fn: Callable[[AsyncClient], Awaitable[T]]) -> T:
        """As Cluster._place, awaited."""
        await self.start()
        tried: list[tuple[str, DeltagymError]] = []
        candidates = self._members.candidates()
        if not candidates:
            await self.refresh()
            candidates = self._members.candidates()
        for m in candidates:
            try:
                out = await fn(m.client)
            except cl.RETRY_ELSEWHERE as e:
                self._members.refused(m.name, e)
                tried.append((m.name, e))
                continue
            self._members.placed(m.name, n)
            return out
        if tried:
            raise cl.placement_error(call, self.target, tried)
        raise cl.no_node(call, self.target, self._members.status())

    async def reset(self, env: str, *, seed: int | None = None, options: Mapping[str, Any] | None = None,
                    run: str = "", group_id: str = "", idempotency_key: str | None = None,
                    lease_ttl: float | None = None, timeout: Any = _DEFAULT) -> AsyncSandboxHandle:
        """Leases a warm sandbox of env on the least-loaded node (as Cluster.reset)."""
        key = idempotency_key or c.new_key()
        deadline = self.timeout if timeout is _DEFAULT else timeout
        return await self._place("Reset", 1, lambda client: client.reset(
            env, seed=seed, options=options, run=run, group_id=group_id, idempotency_key=key, lease_ttl=lease_ttl,
            timeout=deadline))

    async def fork(self, checkpoint_id: str, n: int = 1, *, group_id: str = "", run: str = "",
                   fresh_entropy: bool = False, idempotency_key: str | None = None, lease_ttl: float | None = None,
                   timeout: Any = _DEFAULT) -> list[AsyncSandboxHandle]:
        """Creates n sandboxes at a checkpoint, spread over the nodes by load, each node's part
        made concurrently; a part a node cannot make because the checkpoint cannot move to it
        is made on its owner (as Cluster.fork)."""
        owner = await self.client_for(checkpoint_id)
        deadline = self.timeout if timeout is _DEFAULT else timeout
        key = idempotency_key or c.new_key()
        plan: list[tuple[AsyncClient, int]] = [(m.client, k) for m, k in self._members.fork_plan(n)] or [(owner, n)]

        async def part(client: AsyncClient, k: int) -> list[AsyncSandboxHandle]:
            try:
                kids = await client.fork(checkpoint_id=checkpoint_id, n=k, group_id=group_id, run=run,
                                         fresh_entropy=fresh_entropy, idempotency_key=f"{key}/{client.node}",
                                         lease_ttl=lease_ttl, timeout=deadline)
                self._members.placed(client.node, len(kids))
                return kids
            except DeltagymError as e:
                if client is owner or not cl.moves_not(e):
                    raise
            kids = await owner.fork(checkpoint_id=checkpoint_id, n=k, group_id=group_id, run=run,
                                    fresh_entropy=fresh_entropy, idempotency_key=f"{key}/{owner.node}/for/{client.node}",
                                    lease_ttl=lease_ttl, timeout=deadline)
            self._members.placed(owner.node, len(kids))
            return kids

        results = await asyncio.gather(*(part(client, k) for client, k in plan), return_exceptions=True)
        out: list[AsyncSandboxHandle] = []
        failed: BaseException | None = None
        for r in results:
            if isinstance(r, BaseException):
                failed = failed or r
            else:
                out.extend(r)
        if failed is not None:
            for kid in out:
                try:
                    await kid.close()
                except DeltagymError as e:  # the others are closed all the same
                    log.warning("closing %s after a failed fork: %s", kid.id, e)
            raise failed
        return out

    # --- lifecycle ----------------------------------------------------------------------------

    async def close(self) -> None:
        """Stops the refresh task and closes every node's client, which closes the sandboxes
        still open through them. Idempotent."""
        async with self._refreshing:
            if self._closed:
                return
            self._closed = True
            task, self._task = self._task, None
            clients = self._members.take_all()
        if task is not None and task is not asyncio.current_task():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await _close_all(clients)

    async def __aenter__(self) -> AsyncCluster:
        await self.start()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()


async def _close_all(clients: Sequence[AsyncClient]) -> None:
    results = await asyncio.gather(*(client.close() for client in clients), return_exceptions=True)
    for client, r in zip(clients, results, strict=True):
        if isinstance(r, Exception):  # one client's failure leaves the others to close
            log.warning("closing the client of %s: %s", client.addr, r)
