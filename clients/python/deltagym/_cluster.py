"""What Cluster and AsyncCluster share that does no I/O: the target's parsing, the node an ID
names, the placement score and its water-filling, and the membership each refresh updates.

Membership's lock guards its state; no I/O happens under it, so the asyncio cluster takes it
too (it is never held across an await)."""

from __future__ import annotations

import dataclasses
import ipaddress
import socket
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from ._convert import node_info
from ._proto.deltagym.v1 import node_service_pb2 as ns
from .errors import DeltagymError, Draining, NoCapacity, NodeUnavailable, Unavailable
from .types import NodeInfo

# How an ID names its node (internal/nodeid of the server): PREFIX-NODE-HEX, HEX sixteen
# lowercase hex digits, NODE a node name.
_HEX_LEN = 16
_MAX_NAME = 100
_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyz0123456789-.")
_HEX = frozenset("0123456789abcdef")

# The weights of the score's load terms beside the sandboxes' (see score).
CPU_WEIGHT = 0.5
MEMORY_WEIGHT = 0.5

# How long a GetNode of a refresh may take, at most: a node that does not answer in time is
# taken as unreachable until the next refresh.
PROBE_TIMEOUT = 5.0

# A call on an ID of a node the cluster does not know refreshes first, unless a refresh ended
# less than this many seconds ago: the node may have joined since.
ROUTE_REFRESH = 1.0


def check_name(name: str) -> bool:
    """Whether name can name a node: 1 to 100 lowercase letters, digits, '-' and '.',
    starting and ending with a letter or digit."""
    if not 0 < len(name) <= _MAX_NAME or not set(name) <= _NAME_CHARS:
        return False
    return name[0] not in "-." and name[-1] not in "-."


def node_of(id: str) -> str:
    """The name of the node a sandbox or checkpoint ID names ("sb-NODE-HEX16",
    "ck-NODE-HEX16"); "" for an ID that names none (a node without a name made it, or it
    has another shape), which is the local node's."""
    p = id.find("-")
    q = len(id) - _HEX_LEN - 1
    if p < 0 or q <= p + 1 or id[q] != "-" or not set(id[q + 1:]) <= _HEX:
        return ""
    node = id[p + 1:q]
    return node if check_name(node) else ""


@dataclass(frozen=True)
class Target:
    """Where a cluster's nodes are: every address of a DNS name (dns_name, port), or a fixed list."""

    dns_name: str
    port: int
    static: tuple[str, ...]


_TARGET_FORMS = "dns:NAME:PORT (every address of NAME is a node) or host:port,host:port,..."


def parse_target(target: str) -> Target:
    """Parses a cluster's target: "dns:NAME:PORT" (also "dns:///NAME:PORT"), every address
    NAME resolves to being a node, or a comma-separated list of host:port."""
    t = target.strip()
    if t.startswith("dns:"):
        rest = t[len("dns:///"):] if t.startswith("dns:///") else t[len("dns:"):]
        name, sep, port = rest.rpartition(":")
        if not sep or not name or "/" in name or "," in name or name.startswith("["):
            raise ValueError(f"cluster target {target!r}: want {_TARGET_FORMS}, as dns:deltagym-nodes.default.svc:8080")
        return Target(dns_name=name, port=_port(port, target), static=())
    addrs: list[str] = []
    for part in t.split(","):
        a = part.strip()
        for scheme in ("http://", "grpc://"):
            a = a.removeprefix(scheme)
        a = a.rstrip("/")
        host, sep, port = a.rpartition(":")
        if not sep or not host or (":" in host and not (host.startswith("[") and host.endswith("]"))):
            raise ValueError(f"cluster target {target!r}: {part.strip()!r} is no host:port; want {_TARGET_FORMS}")
        _port(port, target)
        if a not in addrs:
            addrs.append(a)
    return Target(dns_name="", port=0, static=tuple(addrs))


def _port(port: str, target: str) -> int:
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"cluster target {target!r}: the port {port!r} is not a number from 1 to 65535")
    return int(port)


def host_port(ip: str, port: int) -> str:
    """The address of port at ip: "ip:port", "[ip]:port" for IPv6."""
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


def addresses(ips: Iterable[str], port: int) -> list[str]:
    """The addresses of port at each IP, each once, in order. An IP that does not parse is refused."""
    out: list[str] = []
    for ip in ips:
        ipaddress.ip_address(ip.split("%", 1)[0])  # ValueError for what a resolver should not answer
        a = host_port(ip, port)
        if a not in out:
            out.append(a)
    return out


def system_resolver(name: str) -> list[str]:
    """The IPv4 and IPv6 addresses of name, as the system's resolver gives them
    (socket.getaddrinfo: /etc/hosts, then DNS)."""
    infos = socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)
    return ips_of(infos)


def ips_of(infos: Iterable[tuple[Any, ...]]) -> list[str]:
    """The IPs of getaddrinfo's answers, each once, in order."""
    out: list[str] = []
    for info in infos:
        ip = str(info[4][0])
        if ip not in out:
            out.append(ip)
    return out


# --- placement ------------------------------------------------------------------------------


def _full(n: NodeInfo) -> bool:
    return n.max_sandboxes > 0 and n.sandboxes >= n.max_sandboxes


def _scores(nodes: Sequence[NodeInfo]) -> list[float]:
    busiest = max((n.sandboxes for n in nodes), default=0)
    out = []
    for n in nodes:
        held = n.sandboxes / n.max_sandboxes if n.max_sandboxes > 0 else n.sandboxes / (busiest + 1)
        used = 1 - n.memory_available / n.memory_total if n.memory_total > 0 else 0.0
        out.append(held + CPU_WEIGHT * max(n.cpu_load, 0.0) + MEMORY_WEIGHT * min(max(used, 0.0), 1.0))
    return out


def score(node: NodeInfo, nodes: Sequence[NodeInfo]) -> float:
    """How loaded a node is among nodes (lower takes new sandboxes first):

        held + CPU_WEIGHT * cpu_load + MEMORY_WEIGHT * (1 - memory_available / memory_total)

    where held is sandboxes / max_sandboxes on a node with a cap, else sandboxes / (b + 1),
    b the most sandboxes any of nodes holds (relative to the busiest); cpu_load is the load
    average per CPU; a node that does not know its memory counts none used. A capped node
    that holds its max_sandboxes is full: placement tries it after every other one."""
    return _scores([node, *nodes])[0]


def rank(nodes: Sequence[NodeInfo]) -> list[NodeInfo]:
    """The nodes that take new sandboxes (not draining), best first: lowest score, full ones
    last, ties by name."""
    live = [n for n in nodes if not n.draining]
    s = _scores(live)
    order = sorted(range(len(live)), key=lambda i: (_full(live[i]), s[i], live[i].name))
    return [live[i] for i in order]


def spread(n: int, nodes: Sequence[NodeInfo]) -> dict[str, int]:
    """Splits n new sandboxes over nodes by water-filling: each in turn goes to the node of
    lowest score (see rank) counting those placed before it. Returns how many each node
    that is not draining gets (0 included). ValueError when n is negative, or when n > 0 and
    every node drains."""
    if n < 0:
        raise ValueError(f"spread: n must be at least 0, not {n}")
    live = [x for x in nodes if not x.draining]
    counts = {x.name: 0 for x in live}
    if n and not live:
        raise ValueError("spread: no node takes new sandboxes (every one drains)")
    projected = list(live)
    for _ in range(n):
        s = _scores(projected)
        i = min(range(len(projected)), key=lambda j: (_full(projected[j]), s[j], projected[j].name))
        projected[i] = dataclasses.replace(projected[i], sandboxes=projected[i].sandboxes + 1)
        counts[projected[i].name] += 1
    return counts


# --- membership ------------------------------------------------------------------------------


class NodeClient(Protocol):
    """What the membership needs of a node's client (Client, AsyncClient)."""

    addr: str
    node: str

    @property
    def _handles(self) -> set[Any]: ...


C = TypeVar("C", bound=NodeClient)


@dataclass
class Member(Generic[C]):
    """A node the cluster knows, by name.

    Attributes:
        name: its name.
        address: where it was last found.
        client: the client of its calls, at address.
        info: its last report.
        listed: the target listed address at the last refresh.
        reached: the last refresh (or a placement since) reached it.
        placed: sandboxes placed on it since its last report.
        error: why it was not reached, when not.
    """

    name: str
    address: str
    client: C
    info: NodeInfo
    listed: bool = True
    reached: bool = True
    placed: int = 0
    error: str = ""

    def projected(self) -> NodeInfo:
        """Its last report with the sandboxes placed since."""
        return dataclasses.replace(self.info, sandboxes=self.info.sandboxes + self.placed) if self.placed else self.info


Probe = tuple[str, C]


class Membership(Generic[C]):
    """The nodes of a cluster as the refreshes found them: members by name, each with its
    client; the clients asking the addresses that answered no name yet; clients of members
    that moved, kept while they hold sandboxes. A refresh is probe_plan (which client asks
    which address), the GetNode calls, then apply; the caller closes the clients apply
    returns. A node the target no longer lists takes no new sandboxes; it is kept (its
    sandboxes' calls still go to it while it answers: a draining node leaves the DNS answers
    first) until its client holds no sandbox."""

    def __init__(self, target: str, make: Callable[[str], C]) -> None:
        self.target = target
        self._make = make
        self._lock = threading.Lock()
        self._members: dict[str, Member[C]] = {}  # guarded by _lock
        self._probes: dict[str, C] = {}  # guarded by _lock
        self._retired: list[C] = []  # guarded by _lock
        self._unreached: dict[str, str] = {}  # guarded by _lock: address -> why
        self._addrs: list[str] = []  # guarded by _lock
        # Names that answering nodes advertising different addresses report alike (two nodes
        # given one name, or one posing as another), with those addresses: no calls on their
        # IDs, no placements on them, until a refresh finds one again. Guarded by _lock.
        self._clashes: dict[str, list[str]] = {}
        self.refreshed_at = 0.0  # time.monotonic() of the last apply; guarded by _lock

    def addresses(self) -> list[str]:
        """The addresses of the last refresh."""
        with self._lock:
            return list(self._addrs)

    def probe_plan(self, addrs: Sequence[str]) -> list[Probe[C]]:
        """The client to ask at each address: the listed member's found there, else a new one."""
        with self._lock:
            at = {m.address: m.client for m in self._members.values() if m.listed}
            plan = []
            for a in addrs:
                cl = at.get(a) or self._probes.get(a)
                if cl is None:
                    cl = self._probes[a] = self._make(a)
                plan.append((a, cl))
            return plan

    def apply(self, addrs: Sequence[str], plan: Sequence[Probe[C]],
              results: Mapping[str, NodeInfo | str]) -> list[C]:
        """Takes in a refresh: addrs the target listed, plan the probes, results each address's
        report or why it gave none. Returns the clients to close."""
        answered: dict[str, list[str]] = {}
        for a in addrs:
            r = results.get(a)
            if isinstance(r, NodeInfo):
                answered.setdefault(r.name, []).append(a)
        probed = dict(plan)
        clashes: dict[str, list[str]] = {}
        for name, where in answered.items():
            adv = sorted({r.advertise_address for a in where if isinstance(r := results[a], NodeInfo) and r.advertise_address})
            if len(adv) > 1:
                clashes[name] = adv
        with self._lock:
            self._clashes = clashes
            self._addrs = list(addrs)
            self._unreached = {a: r for a, r in results.items() if isinstance(r, str)}
            for name, where in answered.items():
                m = self._members.get(name)
                addr = m.address if m is not None and m.address in where else where[0]
                info = results[addr]
                assert isinstance(info, NodeInfo)
                cl = probed[addr]
                if cl.node not in ("", name):
                    cl = self._make(addr)  # the address's client is another node's: its sandboxes' calls name that node
                self._probes.pop(addr, None)
                cl.node = name
                if m is None:
                    self._members[name] = Member(name=name, address=addr, client=cl, info=info)
                    continue
                if m.client is not cl:
                    self._retired.append(m.client)
                m.address, m.client, m.info = addr, cl, info
                m.listed, m.reached, m.placed, m.error = True, True, 0, ""
            for m in self._members.values():
                if m.name in answered:
                    continue
                if m.address not in addrs:
                    m.listed = False
                elif m.address in self._unreached:
                    m.listed, m.reached, m.error = True, False, self._unreached[m.address]
                else:  # its address answers with another node's name: the node left it
                    m.listed, m.reached, m.error = False, False, f"{m.address} is node {_name_at(results, m.address)} now"
            close = [cl for a, cl in self._probes.items() if a not in addrs]
            self._probes = {a: cl for a, cl in self._probes.items() if a in addrs}
            close += self._forget()
            self.refreshed_at = time.monotonic()
            return close

    def _forget(self) -> list[C]:
        """Drops the members the target no longer lists and the retired clients, once their
        clients hold no sandbox; returns those clients. Holds _lock."""
        close: list[C] = []
        for name in [n for n, m in self._members.items() if not m.listed and not m.client._handles]:
            close.append(self._members.pop(name).client)
        keep: list[C] = []
        for cl in self._retired:
            (keep if cl._handles else close).append(cl)
        self._retired = keep
        return close

    def take_all(self) -> list[C]:
        """Every client, for the cluster's close; the membership is empty after."""
        with self._lock:
            out = [m.client for m in self._members.values()] + list(self._probes.values()) + self._retired
            self._members, self._probes, self._retired = {}, {}, []
            return out

    # --- placement and routing --------------------------------------------------------------

    def candidates(self) -> list[Member[C]]:
        """The members that take new sandboxes (listed, reached, not draining), best first
        by their reports with the sandboxes placed since (rank)."""
        with self._lock:
            live = [m for m in self._members.values() if m.listed and m.reached and m.name not in self._clashes]
            by_name = {m.name: m for m in live}
            return [by_name[n.name] for n in rank([m.projected() for m in live])]

    def fork_plan(self, n: int) -> list[tuple[Member[C], int]]:
        """Splits a fork of n children over the members that take new sandboxes, by load
        (spread); [] when none does."""
        with self._lock:
            live = [m for m in self._members.values()
                    if m.listed and m.reached and not m.info.draining and m.name not in self._clashes]
            if not live:
                return []
            counts = spread(n, [m.projected() for m in live])
            return [(m, counts[m.name]) for m in sorted(live, key=lambda m: m.name) if counts.get(m.name)]

    def placed(self, name: str, n: int) -> None:
        """Counts n sandboxes placed on the node since its report."""
        with self._lock:
            m = self._members.get(name)
            if m is not None:
                m.placed += n

    def refused(self, name: str, err: DeltagymError) -> None:
        """Takes in a placement's refusal: a draining node is draining until a report says
        otherwise, an unreachable one unreached until a refresh reaches it."""
        with self._lock:
            m = self._members.get(name)
            if m is None:
                return
            if isinstance(err, Draining):
                m.info = dataclasses.replace(m.info, draining=True)
            elif isinstance(err, NodeUnavailable):
                m.reached, m.error = False, err.message

    def route(self, id: str, kind: str) -> C | None:
        """The client of the node id names; None when the cluster does not know that node.
        ValueError for an ID of no node when the cluster has more than one."""
        name = node_of(id)
        with self._lock:
            if name in self._clashes:
                raise NodeUnavailable(f"{kind} {id} is on node {name}, and the nodes at {' and '.join(self._clashes[name])} all "
                                      f"report that name: two nodes given one name, or one posing as another; calls on its "
                                      "IDs go nowhere until one is renamed or gone", node=name)
            if name:
                m = self._members.get(name)
                return m.client if m is not None else None
            if len(self._members) == 1:
                return next(iter(self._members.values())).client
            known = sorted(self._members)
        raise ValueError(f"{kind} ID {id!r} names no node (a server without a node name made it), and the cluster "
                         f"{self.target} has {len(known)} nodes ({', '.join(known) or 'none'}): an ID of no node "
                         "is routed only in a cluster of one node; call its server with a deltagym.Client")

    def unknown(self, id: str, kind: str) -> NodeUnavailable:
        """The error of a call on an ID of a node the cluster does not know."""
        name = node_of(id)
        with self._lock:
            known = ", ".join(sorted(self._members)) or "none"
        return NodeUnavailable(f"{kind} {id} is on node {name}, which the cluster {self.target} does not know "
                               f"(its nodes: {known}): the node left, or is not reachable from here", node=name)

    def nodes(self) -> list[NodeInfo]:
        """The reports of the nodes the target lists that the last refresh reached, by name."""
        with self._lock:
            return [m.info for _, m in sorted(self._members.items()) if m.listed and m.reached]

    def clients(self) -> dict[str, C]:
        """The clients of the nodes nodes() reports, by name."""
        with self._lock:
            return {n: m.client for n, m in sorted(self._members.items()) if m.listed and m.reached}

    def status(self) -> str:
        """Why each node and address takes no new sandboxes, for an error's message."""
        with self._lock:
            parts = []
            for name, m in sorted(self._members.items()):
                if not m.listed:
                    parts.append(f"{name} ({m.address}): no longer listed by the target")
                elif not m.reached:
                    parts.append(f"{name} ({m.address}): unreachable: {m.error}")
                elif m.info.draining:
                    parts.append(f"{name} ({m.address}): draining")
                else:
                    parts.append(f"{name} ({m.address}): ready")
            named = {m.address for m in self._members.values()}
            parts += [f"{a}: {why}" for a, why in sorted(self._unreached.items()) if a not in named]
            if not self._addrs and not parts:
                parts.append("the target lists no address")
            return "; ".join(parts)


def _name_at(results: Mapping[str, NodeInfo | str], addr: str) -> str:
    r = results.get(addr)
    return r.name if isinstance(r, NodeInfo) else "?"


def no_node(call: str, target: str, status: str) -> Unavailable:
    """The error of a placement no node of the cluster may take, each node's state in status."""
    return Unavailable(f"no node of the cluster {target} takes the {call}: {status}", method=call)


def report(n: ns.NodeInfo, addr: str) -> NodeInfo | str:
    """A GetNode answer from addr as Membership.apply takes it: the report, or why it is none."""
    if not check_name(n.name):
        return f"{addr} reports no valid node name ({n.name!r})"
    return node_info(n, addr)


def placement_error(call: str, target: str, errors: Sequence[tuple[str, DeltagymError]]) -> DeltagymError:
    """The error of a placement every node refused: the one node's own; else, naming each
    node's, a NoCapacity when every node was full, an Unavailable otherwise."""
    if len(errors) == 1:
        return errors[0][1]
    why = "; ".join(f"{name}: {e.message}" for name, e in errors)
    msg = f"no node of the cluster {target} took the {call}: {why}"
    if all(isinstance(e, NoCapacity) for _, e in errors):
        return NoCapacity(msg, method=call, reason="NO_CAPACITY")
    return Unavailable(msg, method=call)


# The errors on which a placement tries the next node: the node drains, is full or is gone.
RETRY_ELSEWHERE = (Draining, NoCapacity, NodeUnavailable)

# The reasons of a node's refusal of another node's checkpoint that its owner can serve: its
# processes stay on their node, or the owner is out of the node's reach.
MOVES_NOT = ("PROCESSES_STAY", "NODE_UNAVAILABLE")


def moves_not(e: DeltagymError) -> bool:
    """Whether e refuses a checkpoint that cannot move to the node asked, which its owner can
    fork instead."""
    return e.reason in MOVES_NOT
