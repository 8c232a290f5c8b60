"""deltagym.Cluster: the client of a cluster of deltagym nodes, which routes each call itself
(no router in the data path).

    import deltagym

    with deltagym.Cluster("dns:deltagym-nodes.default.svc:8080") as cluster:
        with deltagym.Sandbox.create("shell", cluster=cluster) as sb:   # on the least-loaded node
            sb.run("echo hi")
            kids = deltagym.Sandbox.fork_from(sb.checkpoint(), 4, cluster=cluster)  # the checkpoint's node

A Cluster finds the nodes (every address of a DNS name, or a fixed list), asks each for its
name and load (NodeService.GetNode) every `refresh` seconds, and keeps a deltagym.Client per
node. New sandboxes go to the least-loaded node that is not draining (score, spread); every
call on a sandbox or checkpoint goes to the node its ID names (node_of).
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import grpc

from . import _cluster as cl, _common as c
from ._cluster import CPU_WEIGHT, MEMORY_WEIGHT, node_of, rank, score, spread
from ._proto.deltagym.v1 import env_service_pb2 as es, node_service_pb2 as ns
from .client import Client, SandboxHandle
from .errors import DeltagymError
from .types import Checkpoint, CheckpointDiff, DiffDetail, NodeInfo

__all__ = ["CPU_WEIGHT", "MEMORY_WEIGHT", "Cluster", "Resolver", "node_of", "rank", "score", "spread"]

log = logging.getLogger("deltagym")

Resolver = Callable[[str], Sequence[str]]
"""A resolver of a cluster's DNS name: the name, to its IPs (IPv4 or IPv6, as text)."""

# The deadline argument's default: the cluster's own timeout.
_DEFAULT: Any = object()

T = TypeVar("T")


class Cluster:
    """A cluster of deltagym nodes, each call sent to the node it belongs to.

    Args:
        target: "dns:NAME:PORT": every IPv4 and IPv6 address NAME resolves to is a node (a
            Kubernetes headless Service's name), resolved again at each refresh; or
            "host:port,host:port,...", a fixed list.
        token: bearer token of every node; default as for Client ($DELTAGYM_TOKEN ...).
        refresh: seconds between refreshes (resolving the target, asking each node for its load).
        resolver: resolves the DNS name to IPs instead of the system's resolver (socket.getaddrinfo).
        timeout: deadline in seconds of each call; None means no deadline.
        retry: how each node's client retries safe calls on UNAVAILABLE.
        heartbeat: whether sandbox handles renew their leases in a background thread.

    The first refresh happens here: nodes() reports what it found. A background thread
    refreshes every `refresh` seconds until close(); `with` closes the cluster, which closes
    every node's client and with them the sandboxes made through it (as Client.close does).

    Placement: reset (and Sandbox.create(..., cluster=)) goes to the best node of rank(): the
    least-loaded by score() of the nodes the last refresh reached that are not draining,
    counting the sandboxes this cluster placed since their reports. A node that refuses it
    because it drains (Draining), is full (NoCapacity) or cannot be reached (NodeUnavailable)
    is passed over until the next refresh, and the call goes to the next node; each node is
    tried once. fork goes whole to the node holding the checkpoint.

    Routing: a call on a sandbox or checkpoint goes to the node its ID names. An ID of a node
    the cluster does not know raises NodeUnavailable (after a refresh, in case the node just
    joined); an ID of no node, ValueError, unless the cluster has one node. A node that stops
    answering makes the calls on its sandboxes raise NodeUnavailable naming it and its
    address. A node that the target no longer lists (a draining node leaves its Service's
    DNS answers first) takes no new sandboxes, and the calls on the sandboxes it holds still
    go to it while it answers; it is forgotten once its client holds no sandbox.
    """

    def __init__(self, target: str, *, token: str | None = None, refresh: float = 10.0,
                 resolver: Resolver | None = None, timeout: float | None = None,
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
        self._resolver: Resolver = resolver or cl.system_resolver
        self._members: cl.Membership[Client] = cl.Membership(target, self._make)
        self._refreshing = threading.Lock()  # one refresh at a time; guards _closed
        self._closed = False
        self._stop = threading.Event()
        try:
            self.refresh()
        except BaseException:
            _close_all(self._members.take_all())
            raise
        self._thread = threading.Thread(target=self._refresher, name="deltagym-cluster-refresh", daemon=True)
        self._thread.start()

    def __repr__(self) -> str:
        return f"Cluster({self.target!r}, nodes={[n.name for n in self.nodes()]})"

    def _make(self, addr: str) -> Client:
        return Client(addr, token=self._token, timeout=self.timeout, retry=self.retry, heartbeat=self.heartbeat_enabled)

    # --- discovery ----------------------------------------------------------------------------

    def _resolve(self) -> list[str]:
        t = self._target
        if not t.dns_name:
            return list(t.static)
        try:
            return cl.addresses(self._resolver(t.dns_name), t.port)
        except Exception as e:  # a resolver's failure is no reason to forget the nodes found before
            log.warning("cluster %s: resolving %s: %s; keeping the addresses found before", self.target, t.dns_name, e)
            return self._members.addresses()

    def refresh(self) -> list[NodeInfo]:
        """Resolves the target and asks every address for its node and load now (the
        background thread does it every `refresh` seconds); returns nodes()."""
        with self._refreshing:
            if self._closed:
                raise ValueError("the cluster is closed")
            addrs = self._resolve()
            plan = self._members.probe_plan(addrs)
            calls = [(a, client, client._node_service.GetNode.future(ns.GetNodeRequest(), metadata=client._md,
                                                                      timeout=cl.PROBE_TIMEOUT))
                     for a, client in plan]
            results: dict[str, NodeInfo | str] = {}
            for a, client, call in calls:
                try:
                    results[a] = cl.report(call.result().node, a)
                except grpc.RpcError as e:
                    results[a] = str(client._error(e, "GetNode"))
            close = self._members.apply(addrs, plan, results)
        _close_all(close)
        return self.nodes()

    def _refresher(self) -> None:
        while not self._stop.wait(self.refresh_interval):
            try:
                self.refresh()
            except Exception as e:  # the next refresh tries again
                if self._stop.is_set():
                    return
                log.warning("cluster %s: refresh: %s", self.target, e)

    def nodes(self) -> list[NodeInfo]:
        """The last reports of the nodes: those the target lists that the last refresh
        reached (draining ones included), by name."""
        return self._members.nodes()

    def clients(self) -> dict[str, Client]:
        """The Client of each node nodes() reports, by name: for the calls no ID routes
        (list_sandboxes, the ledger's queries), asked of each node."""
        return self._members.clients()

    # --- routing ------------------------------------------------------------------------------

    def client_for(self, id: str) -> Client:
        """The Client of the node a sandbox or checkpoint ID names: every call on the ID
        goes there. NodeUnavailable when the cluster does not know the node (after a
        refresh); ValueError for an ID of no node, unless the cluster has one node."""
        kind = "checkpoint" if id.startswith("ck-") else "sandbox"
        found = self._members.route(id, kind)
        if found is None and time.monotonic() - self._members.refreshed_at >= cl.ROUTE_REFRESH:
            self.refresh()
            found = self._members.route(id, kind)
        if found is None:
            raise self._members.unknown(id, kind)
        return found

    def diff_checkpoints(self, base: Checkpoint | str, checkpoint: Checkpoint | str, *, detail: DiffDetail = "paths",
                         path: str | None = None, max_paths: int | None = None,
                         timeout: Any = _DEFAULT) -> CheckpointDiff:
        """What differs from base to checkpoint (as Client.diff_checkpoints), asked of the
        node that holds checkpoint, which fetches base from its own node when it must."""
        ck = c.checkpoint_id(checkpoint)
        return self.client_for(ck).diff_checkpoints(base, ck, detail=detail, path=path, max_paths=max_paths,
                                                    timeout=self.timeout if timeout is _DEFAULT else timeout)

    def list_checkpoints(self, *, env: str = "", run: str = "", group_id: str = "", episode_id: str = "",
                         timeout: Any = _DEFAULT) -> list[es.CheckpointSummary]:
        """The checkpoints every node holds (as Client.list_checkpoints), oldest first."""
        deadline = self.timeout if timeout is _DEFAULT else timeout
        out = [ck for client in self.clients().values()
               for ck in client.list_checkpoints(env=env, run=run, group_id=group_id, episode_id=episode_id,
                                                 timeout=deadline)]
        return sorted(out, key=lambda ck: (ck.create_time.seconds, ck.create_time.nanos))

    # --- placement ----------------------------------------------------------------------------

    def _place(self, call: str, n: int, fn: Callable[[Client], T]) -> T:
        """Runs fn on the best node, and on the next on a refusal (Draining, NoCapacity,
        NodeUnavailable), each node once; refreshes first when no node is known to take it."""
        tried: list[tuple[str, DeltagymError]] = []
        candidates = self._members.candidates()
        if not candidates:
            self.refresh()
            candidates = self._members.candidates()
        for m in candidates:
            try:
                out = fn(m.client)
            except cl.RETRY_ELSEWHERE as e:
                self._members.refused(m.name, e)
                tried.append((m.name, e))
                continue
            self._members.placed(m.name, n)
            return out
        if tried:
            raise cl.placement_error(call, self.target, tried)
        raise cl.no_node(call, self.target, self._members.status())

    def reset(self, env: str, *, seed: int | None = None, options: Mapping[str, Any] | None = None, run: str = "",
              group_id: str = "", idempotency_key: str | None = None, lease_ttl: float | None = None,
              timeout: Any = _DEFAULT) -> SandboxHandle:
        """Leases a warm sandbox of env on the least-loaded node and starts an episode (as
        Client.reset); the handle's calls go to that node."""
        key = idempotency_key or c.new_key()
        deadline = self.timeout if timeout is _DEFAULT else timeout
        return self._place("Reset", 1, lambda client: client.reset(
            env, seed=seed, options=options, run=run, group_id=group_id, idempotency_key=key, lease_ttl=lease_ttl,
            timeout=deadline))

    def fork(self, checkpoint_id: str, n: int = 1, *, group_id: str = "", run: str = "", fresh_entropy: bool = False,
             idempotency_key: str | None = None, lease_ttl: float | None = None,
             timeout: Any = _DEFAULT) -> list[SandboxHandle]:
        """Creates n sandboxes at a checkpoint (as Client.fork), spread over the nodes by load:
        a GRPO group forked from one checkpoint lands on every node in one call, each node's
        part made in parallel (a node fetches the checkpoint from its owner once, then holds
        it). A part that a node cannot make because the checkpoint cannot move to it (its
        processes have no CRIU images, so they stay on their node; the owner is out of its
        reach) is made on the owner instead. Each handle's calls go to the node that made it. When a part fails,
        the children of the others are closed and the error raised."""
        owner = self.client_for(checkpoint_id)
        deadline = self.timeout if timeout is _DEFAULT else timeout
        key = idempotency_key or c.new_key()
        plan: list[tuple[Client, int]] = [(m.client, k) for m, k in self._members.fork_plan(n)] or [(owner, n)]

        def part(client: Client, k: int) -> list[SandboxHandle]:
            try:
                kids = client.fork(checkpoint_id=checkpoint_id, n=k, group_id=group_id, run=run,
                                   fresh_entropy=fresh_entropy, idempotency_key=f"{key}/{client.node}",
                                   lease_ttl=lease_ttl, timeout=deadline)
                self._members.placed(client.node, len(kids))
                return kids
            except DeltagymError as e:
                if client is owner or not cl.moves_not(e):
                    raise
            kids = owner.fork(checkpoint_id=checkpoint_id, n=k, group_id=group_id, run=run, fresh_entropy=fresh_entropy,
                              idempotency_key=f"{key}/{owner.node}/for/{client.node}", lease_ttl=lease_ttl,
                              timeout=deadline)
            self._members.placed(owner.node, len(kids))
            return kids

        if len(plan) == 1:
            return part(*plan[0])
        with concurrent.futures.ThreadPoolExecutor(max_workers=len(plan)) as pool:
            futures = [pool.submit(part, client, k) for client, k in plan]
            concurrent.futures.wait(futures)
        out: list[SandboxHandle] = []
        failed: BaseException | None = None
        for f in futures:
            e = f.exception()
            if e is None:
                out.extend(f.result())
            elif failed is None:
                failed = e
        if failed is not None:
            for kid in out:
                try:
                    kid.close()
                except DeltagymError as e:  # the others are closed all the same
                    log.warning("closing %s after a failed fork: %s", kid.id, e)
            raise failed
        return out

    # --- lifecycle ----------------------------------------------------------------------------

    def close(self) -> None:
        """Stops the refreshes and closes every node's client, which closes the sandboxes
        still open through them. Idempotent."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join()
        with self._refreshing:
            if self._closed:
                return
            self._closed = True
            clients = self._members.take_all()
        _close_all(clients)

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _close_all(clients: Sequence[Client]) -> None:
    for client in clients:
        try:
            client.close()
        except Exception as e:  # one client's failure leaves the others to close
            log.warning("closing the client of %s: %s", client.addr, e)
