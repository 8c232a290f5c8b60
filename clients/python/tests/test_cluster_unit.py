"""Unit tests of the cluster clients (deltagym.Cluster, deltagym.aio.AsyncCluster) against
in-process fake nodes (tests/fake_server.py): placement, routing, draining, nodes that leave,
move or stop. No deltagym server, no root."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Iterator

import pytest

import deltagym
from deltagym import RetryPolicy, _cluster, errors
from deltagym._cluster import Membership, node_of, parse_target
from deltagym.aio import AsyncCluster, AsyncSandbox
from deltagym.cluster import rank, score, spread
from deltagym.types import NodeInfo

from .fake_server import FakeSandbox, FakeServer

# Quick retries: a stopped fake node is given up on within a fraction of a second.
QUICK = RetryPolicy(max_attempts=2, initial_backoff=0.01, max_backoff=0.01)
# Longer than any test: the tests refresh when they mean to.
REFRESH = 300.0


def _nodes(*names: str) -> Iterator[list[FakeServer]]:
    fakes = [FakeServer(n) for n in names]
    yield fakes
    for f in fakes:
        f.stop()


@pytest.fixture
def two() -> Iterator[list[FakeServer]]:
    yield from _nodes("a", "b")


@pytest.fixture
def three() -> Iterator[list[FakeServer]]:
    yield from _nodes("a", "b", "c")


def _static(fakes: list[FakeServer]) -> str:
    return ",".join(f.addr for f in fakes)


def _on_one_port(names: list[str], ips: list[str]) -> list[FakeServer]:
    """Fake nodes on ips (loopback addresses), all on one port, as a headless Service's pods are."""
    for _ in range(20):
        first = FakeServer(names[0], host=ips[0])
        made = [first]
        try:
            made += [FakeServer(n, host=ip, port=first.port) for n, ip in zip(names[1:], ips[1:], strict=True)]
        except RuntimeError:  # the port is taken on another address: try another
            for f in made:
                f.stop()
            continue
        return made
    raise AssertionError("no port free on every address")


def _cluster_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(("deltagym-cluster", "deltagym-heartbeat"))]


def node(name: str, sandboxes: int = 0, *, cap: int = 0, cpu: float = 0.0, draining: bool = False,
         mem: tuple[int, int] = (0, 0)) -> NodeInfo:
    return NodeInfo(name=name, address=f"{name}:1", sandboxes=sandboxes, max_sandboxes=cap, cpu_load=cpu,
                    draining=draining, memory_available=mem[0], memory_total=mem[1])


# --- pure parts -----------------------------------------------------------------------------


@pytest.mark.parametrize(("id", "want"), [
    ("sb-node-a-3f2a9c0d1e4b5a69", "node-a"),
    ("ck-a.b-0123456789abcdef", "a.b"),
    ("sb-n-0123456789abcdef", "n"),
    ("sb-3f2a9c0d1e4b5a69", ""),  # a node without a name made it
    ("3f2a9c0d1e4b5a693f2a9c0d1e4b5a69", ""),  # no dash at all
    ("sb--0123456789abcdef", ""),  # an empty name
    ("sb-Node-0123456789abcdef", ""),  # upper case is no name
    ("sb-a--0123456789abcdef", ""),  # a name ends with a letter or digit
    ("sb--a-0123456789abcdef", ""),
    ("sb-a-0123456789ABCDEF", ""),  # the random part is lowercase hex
    ("sb-a-0123456789abcde", ""),  # fifteen digits
    ("sb-a_b-0123456789abcdef", ""),
    ("sb-" + "n" * 100 + "-0123456789abcdef", "n" * 100),
    ("sb-" + "n" * 101 + "-0123456789abcdef", ""),
    ("", ""),
])
def test_node_of_reads_ids_as_the_server_makes_them(id: str, want: str) -> None:
    assert node_of(id) == want


def test_parse_target() -> None:
    t = parse_target("dns:deltagym-nodes.default.svc:8080")
    assert (t.dns_name, t.port, t.static) == ("deltagym-nodes.default.svc", 8080, ())
    assert parse_target("dns:///nodes:9").dns_name == "nodes"
    assert parse_target(" 10.0.0.1:8080, http://b:8080/ ,10.0.0.1:8080,[::1]:7").static == (
        "10.0.0.1:8080", "b:8080", "[::1]:7")
    for bad in ["", "dns:nodes", "dns:nodes:http", "dns::8080", "dns:nodes:0", "dns:a,b:1", "a:1,,b:2", "host",
                "::1:8080", "a:99999"]:
        with pytest.raises(ValueError, match="cluster target"):
            parse_target(bad)


def test_spread_three_equal_nodes_share_evenly() -> None:
    got = spread(64, [node("a"), node("b"), node("c")])
    assert sum(got.values()) == 64
    for n in got.values():
        assert abs(n - 64 / 3) <= 0.1 * 64 / 3, got


def test_spread_preloaded_node_gets_fewer() -> None:
    got = spread(64, [node("a", 30), node("b"), node("c")])
    assert sum(got.values()) == 64
    assert got["a"] < got["b"] and got["a"] < got["c"], got
    # Water-filling: b and c fill up to a's 30 first, then all three share what is left.
    assert got["a"] <= 2 and abs(got["b"] - got["c"]) <= 1, got


def test_spread_by_cap_cpu_memory_and_drain() -> None:
    # Capped: half a node of 100 holds as much as a quarter of 200 does twice: the second first.
    got = spread(100, [node("a", 50, cap=100), node("b", 50, cap=200)])
    assert got["b"] > got["a"] and (50 + got["a"]) / 100 == pytest.approx((50 + got["b"]) / 200, abs=0.02)
    # A full node gets none while another has room.
    assert spread(10, [node("a", 4, cap=4), node("b", 0, cap=100)]) == {"a": 0, "b": 10}
    # A busy CPU and little memory left take a node's share down.
    assert spread(30, [node("a", cpu=1.0), node("b")])["a"] < 15
    assert spread(30, [node("a", mem=(1, 10)), node("b", mem=(9, 10))])["a"] < 15
    # A draining node gets none, and is not in the answer.
    assert spread(9, [node("a", draining=True), node("b"), node("c")]) == {"b": 5, "c": 4}
    assert spread(0, [node("a", draining=True)]) == {}
    with pytest.raises(ValueError, match="drains"):
        spread(1, [node("a", draining=True)])
    with pytest.raises(ValueError, match="at least 0"):
        spread(-1, [node("a")])


def test_score_is_the_documented_sum() -> None:
    nodes = [node("a", 10), node("b", 3, cpu=0.4, mem=(3 << 30, 4 << 30)), node("c", 5, cap=20)]
    assert score(nodes[1], nodes) == pytest.approx(3 / 11 + 0.5 * 0.4 + 0.5 * 0.25)
    assert score(nodes[2], nodes) == pytest.approx(5 / 20)
    assert [n.name for n in rank([*nodes, node("d", draining=True), node("e", 1, cap=1)])] == ["c", "b", "a", "e"]


# --- placement ------------------------------------------------------------------------------


def test_reset_goes_to_the_least_loaded_node_and_spreads(three: list[FakeServer]) -> None:
    a, b, c = three
    with deltagym.Cluster(_static(three), token="t", refresh=REFRESH, heartbeat=False) as cluster:
        assert [(n.name, n.address, n.sandboxes) for n in cluster.nodes()] == [
            ("a", a.addr, 0), ("b", b.addr, 0), ("c", c.addr, 0)]
        assert a.nodes.tokens == ["Bearer t"]  # GetNode carries the token
        # Between refreshes the cluster counts what it placed: 30 resets spread 10, 10, 10.
        hs = [cluster.reset("shell") for _ in range(30)]
        assert [f.service.resets for f in three] == [10, 10, 10]
        assert {node_of(h.id) for h in hs} == {"a", "b", "c"}
        # A node that reports 30 more sandboxes gets none until the others catch up.
        a.nodes.preloaded = 30
        assert {n.name: n.sandboxes for n in cluster.refresh()} == {"a": 40, "b": 10, "c": 10}
        for _ in range(20):
            cluster.reset("shell")
        assert [f.service.resets for f in three] == [10, 20, 20]


def test_draining_node_is_passed_over(two: list[FakeServer]) -> None:
    a, b = two
    b.nodes.cpu_load = 1.0  # a is the best node
    with deltagym.Cluster(_static(two), token="t", refresh=REFRESH, heartbeat=False) as cluster:
        a.service.draining = True  # since the last report
        h = cluster.reset("shell")
        assert node_of(h.id) == "b" and h.client.node == "b"
        assert a.service.resets == 1  # DRAINING is not retried on the node
        assert [n.draining for n in cluster.nodes()] == [True, False]  # until a report says otherwise
        cluster.reset("shell")
        assert a.service.resets == 1 and b.service.resets == 2
        # Every node draining: the one tried says so; once the reports say it, the error names each.
        b.service.draining = True
        with pytest.raises(errors.Draining, match="node b is draining"):
            cluster.reset("shell")
        cluster.refresh()
        with pytest.raises(errors.Unavailable, match=r"takes the Reset: a \(.*\): draining; b \(.*\): draining"):
            cluster.reset("shell")
        a.service.draining = b.service.draining = False
        cluster.refresh()
        assert node_of(cluster.reset("shell").id) == "a"


def test_one_node_refusal_is_its_own(two: list[FakeServer]) -> None:
    a, _ = two
    with deltagym.Cluster(a.addr, token="t", refresh=REFRESH, heartbeat=False) as cluster:
        a.service.draining = True
        with pytest.raises(errors.Draining) as ei:
            cluster.reset("shell")
        assert ei.value.node == "a"
        a.service.draining, a.service.max_sandboxes = False, 1
        cluster.refresh()
        cluster.reset("shell")
        with pytest.raises(errors.NoCapacity):
            cluster.reset("shell")


def test_full_node_sends_reset_elsewhere(two: list[FakeServer]) -> None:
    a, b = two
    a.service.max_sandboxes = 1
    b.service.max_sandboxes = 100
    with deltagym.Cluster(_static(two), token="t", refresh=REFRESH, heartbeat=False) as cluster:
        assert node_of(cluster.reset("shell").id) == "a"  # 0 of 1 ties 0 of 100: by name
        assert node_of(cluster.reset("shell").id) == "b"  # a is full by what the cluster placed there
        a.nodes.preloaded = -1  # a report that hides a's sandbox: a seems to have room
        cluster.refresh()
        assert node_of(cluster.reset("shell").id) == "b"  # a refused it (NO_CAPACITY), b took it
        assert a.service.resets == 2 and b.service.open_sandboxes() == 2


# --- routing --------------------------------------------------------------------------------


def test_calls_go_to_the_node_the_id_names(two: list[FakeServer], monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = two
    with deltagym.Cluster(_static(two), token="t", refresh=REFRESH, heartbeat=False) as cluster:
        b_sb = b.service._id("sb")
        b.service.sandboxes[b_sb] = FakeSandbox(id=b_sb, env="shell", episode="ep")
        client = cluster.client_for(b_sb)
        assert client.node == "b" and client.addr == b.addr
        assert client.step(b_sb, "echo hi").observation.exec.stdout == b"hi\n"
        with deltagym.Sandbox.connect(b_sb, cluster=cluster) as sb:
            assert sb.client is client and sb.run("echo there").stdout == "there\n"
            ck = sb.checkpoint()
            assert node_of(ck.id) == "b"
            # A fork spreads over the nodes by load: node a forks node b's checkpoint too.
            kids = deltagym.Sandbox.fork_from(ck, 4, cluster=cluster)
            assert {node_of(k.id) for k in kids} == {"a", "b"}
            assert all(k.client is cluster.clients()[node_of(k.id)] for k in kids)
            assert {k.env for k in kids} == {"shell"}
            for k in kids:
                k.close()
            # One whose processes stay on node b (PROCESSES_STAY on node a) is made on node b whole.
            kids = deltagym.Sandbox.fork_from("ck-b-000000000000beef", 3, cluster=cluster)
            assert {node_of(k.id) for k in kids} == {"b"} and all(k.client is client for k in kids)
            for k in kids:
                k.close()
        assert all(s.closed for s in a.service.sandboxes.values()) and a.service.execs == []
        # An ID of a node the cluster does not know: NodeUnavailable naming it, after a refresh
        # unless one ended within ROUTE_REFRESH seconds.
        gets = len(a.nodes.tokens)
        with pytest.raises(errors.NodeUnavailable, match=r"sandbox sb-zed-0123456789abcdef is on node zed, which the "
                                                         r"cluster .* does not know \(its nodes: a, b\)") as ei:
            cluster.client_for("sb-zed-0123456789abcdef")
        assert ei.value.node == "zed" and ei.value.address == "" and len(a.nodes.tokens) == gets
        monkeypatch.setattr(_cluster, "ROUTE_REFRESH", 0.0)
        with pytest.raises(errors.NodeUnavailable, match="ck-zed-0123456789abcdef is on node zed"):
            cluster.fork("ck-zed-0123456789abcdef", 2)
        assert len(a.nodes.tokens) == gets + 1
        # An ID of no node: routed only in a cluster of one node.
        with pytest.raises(ValueError, match=r"names no node .* has 2 nodes \(a, b\)"):
            cluster.client_for("sb-0123456789abcdef")
    with deltagym.Cluster(b.addr, token="t", refresh=REFRESH, heartbeat=False) as one:
        assert one.client_for("sb-0123456789abcdef").node == "b"


def test_typed_sandbox_on_a_cluster(two: list[FakeServer]) -> None:
    a, b = two
    a.nodes.preloaded = 5
    with deltagym.Cluster(_static(two), token="t", refresh=REFRESH) as cluster:
        with deltagym.Sandbox.create("shell", cluster=cluster, timeout=10) as sb:
            assert sb.client.node == "b" and sb.task == "write 42" and sb.run("echo hi").stdout == "hi\n"
            kids = sb.fork(2)
            assert {node_of(k.id) for k in kids} == {"b"}
            for k in kids:
                k.close()
        assert b.service.sandboxes[sb.id].closed
        with pytest.raises(ValueError, match="drop addr="):
            deltagym.Sandbox.create("shell", cluster=cluster, addr=a.addr)
        with pytest.raises(ValueError, match="drop client=, token="):
            deltagym.Sandbox.connect("sb-a-0123456789abcdef", cluster=cluster, client=cluster.clients()["a"], token="t")


# --- nodes that stop, leave, join and move -------------------------------------------------------


def test_stopped_node_raises_node_unavailable_and_work_goes_on(two: list[FakeServer]) -> None:
    a, b = two
    with deltagym.Cluster(_static(two), token="t", refresh=REFRESH, retry=QUICK, heartbeat=False) as cluster:
        on_a = cluster.reset("shell")
        on_b = cluster.reset("shell")
        assert (node_of(on_a.id), node_of(on_b.id)) == ("a", "b")
        a.stop()
        for call in (lambda: on_a.exec("echo hi"), on_a.describe, on_a.evaluate):
            with pytest.raises(errors.NodeUnavailable) as ei:
                call()
            e = ei.value
            assert isinstance(e, errors.Unavailable) and (e.node, e.address) == ("a", a.addr)
            assert f"node a ({a.addr}) is unavailable" in str(e)
        assert on_b.exec("echo hi").observation.exec.stdout == b"hi\n"
        # a looks best (it holds one sandbox, as b does; by name), refuses, and b takes the reset.
        assert node_of(cluster.reset("shell").id) == "b"
        assert node_of(cluster.reset("shell").id) == "b"  # a is passed over until a refresh reaches it
        assert [n.name for n in cluster.refresh()] == ["b"]
        with pytest.raises(errors.NodeUnavailable, match=f"node a \\({a.addr}\\)"):
            cluster.client_for(on_a.id).get_sandbox(on_a.id)
        b.service.draining = True
        cluster.refresh()
        with pytest.raises(errors.Unavailable, match=r"takes the Reset: a \(.*\): unreachable: .*; b \(.*\): draining") as ei2:
            cluster.reset("shell")
        assert not isinstance(ei2.value, errors.NodeUnavailable)


def test_node_unlisted_by_dns_takes_no_new_work() -> None:
    a, b = _on_one_port(["a", "b"], ["127.0.0.2", "127.0.0.3"])
    answer = ["127.0.0.2", "127.0.0.3"]
    asked: list[str] = []

    def resolver(name: str) -> list[str]:
        asked.append(name)
        return list(answer)

    try:
        with deltagym.Cluster(f"dns:nodes.test:{a.port}", token="t", refresh=REFRESH, resolver=resolver,
                              heartbeat=False) as cluster:
            assert asked == ["nodes.test"]
            assert [(n.name, n.address) for n in cluster.nodes()] == [("a", a.addr), ("b", b.addr)]
            on_a = cluster.reset("shell")
            assert node_of(on_a.id) == "a"
            answer.remove("127.0.0.2")  # a drains: its pod leaves the Service's answers
            assert [n.name for n in cluster.refresh()] == ["b"]
            assert {node_of(cluster.reset("shell").id) for _ in range(3)} == {"b"}
            # a's sandboxes still reach it while it answers.
            assert on_a.exec("echo still").observation.exec.stdout == b"still\n"
            assert cluster.client_for(on_a.id) is on_a.client
            # Once a's client holds no sandbox, the cluster forgets a.
            on_a.close()
            cluster.refresh()
            with pytest.raises(errors.NodeUnavailable, match=r"on node a, which the cluster .* does not know"):
                cluster.client_for(on_a.id)
            # A node that joins is found at the next refresh.
            answer.append("127.0.0.2")
            assert [n.name for n in cluster.refresh()] == ["a", "b"]
            # A resolver that fails keeps the addresses found before.
            answer.append("not an IP")
            assert [n.name for n in cluster.refresh()] == ["a", "b"]
    finally:
        a.stop()
        b.stop()


def test_node_that_moves_keeps_its_name() -> None:
    a1, b = _on_one_port(["a", "b"], ["127.0.0.2", "127.0.0.3"])
    answer = ["127.0.0.2", "127.0.0.3"]
    a2 = None
    try:
        with deltagym.Cluster(f"dns:nodes.test:{a1.port}", token="t", refresh=REFRESH, resolver=lambda _: answer,
                              retry=QUICK, heartbeat=False) as cluster:
            old = cluster.reset("shell")
            assert node_of(old.id) == "a"
            a1.stop()  # a restarts on another address
            a2 = FakeServer("a", host="127.0.0.4", port=a1.port)
            answer[0] = "127.0.0.4"
            assert [(n.name, n.address) for n in cluster.refresh()] == [("a", a2.addr), ("b", b.addr)]
            new = cluster.reset("shell")
            assert node_of(new.id) == "a" and new.client.addr == a2.addr
            assert new.exec("echo new").observation.exec.stdout == b"new\n"
            # The sandbox of the node's former life: its calls name the node at the address it had.
            with pytest.raises(errors.NodeUnavailable, match=f"node a \\({a1.addr}\\)"):
                old.exec("echo old")
            # An address that answers with another node's name: the node left it.
            b.stop()
            b2 = FakeServer("c", host="127.0.0.3", port=a1.port)
            try:
                assert [n.name for n in cluster.refresh()] == ["a", "c"]
                assert cluster.client_for("sb-c-0123456789abcdef").node == "c"
            finally:
                b2.stop()
    finally:
        for f in (a1, b, a2):
            if f is not None:
                f.stop()


def test_default_resolver_and_close_leaves_no_thread() -> None:
    before = set(_cluster_threads())
    a = FakeServer("a")
    try:
        cluster = deltagym.Cluster(f"dns:localhost:{a.port}", token="t", refresh=REFRESH)
        # localhost resolves through the system's resolver; an address nothing listens on (::1) is no node.
        assert [(n.name, n.address) for n in cluster.nodes()] == [("a", a.addr)]
        sb = deltagym.Sandbox.create("shell", cluster=cluster)
        assert set(_cluster_threads()) - before  # the refresher, the sandbox's heartbeats
        cluster.close()
        cluster.close()
        assert set(_cluster_threads()) == before
        assert a.service.sandboxes[sb.id].closed  # closing the cluster closes its nodes' sandboxes
        with pytest.raises(ValueError, match="closed"):
            cluster.refresh()
    finally:
        a.stop()


def test_refresher_runs_every_refresh_seconds(two: list[FakeServer]) -> None:
    a, _ = two
    with deltagym.Cluster(_static(two), token="t", refresh=0.05, heartbeat=False):
        for _ in range(3):  # the first refresh, then the background thread's
            assert a.nodes.asked.acquire(timeout=10)


def test_no_node_answers(two: list[FakeServer]) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"  # bound, not listening: refused
        with deltagym.Cluster(dead, token="t", refresh=REFRESH, retry=QUICK) as cluster:
            assert cluster.nodes() == []
            with pytest.raises(errors.Unavailable, match=f"no node of the cluster {dead} takes the Reset: {dead}: "):
                cluster.reset("shell")
    with pytest.raises(ValueError, match="refresh"):
        deltagym.Cluster(two[0].addr, refresh=0)


def test_membership_forgets_only_idle_clients() -> None:
    class C:
        def __init__(self, addr: str) -> None:
            self.addr, self.node, self._handles = addr, "", set[str]()

    m: Membership[C] = Membership("t", C)
    plan = m.probe_plan(["x:1"])
    assert m.apply(["x:1"], plan, {"x:1": node("a")}) == []
    ca = plan[0][1]
    assert ca.node == "a" and m.route("sb-a-0123456789abcdef", "sandbox") is ca
    ca._handles.add("sb")
    plan = m.probe_plan([])
    assert m.apply([], plan, {}) == [] and m.nodes() == [] and m.route("sb-a-0123456789abcdef", "sandbox") is ca
    ca._handles.clear()
    assert m.apply([], m.probe_plan([]), {}) == [ca]
    assert m.route("sb-a-0123456789abcdef", "sandbox") is None


# --- asyncio --------------------------------------------------------------------------------


def test_async_cluster(two: list[FakeServer]) -> None:
    a, b = two
    b.nodes.preloaded = 3

    async def main() -> None:
        before = {t.get_name() for t in asyncio.all_tasks()}
        async with AsyncCluster(_static(two), token="t", refresh=REFRESH, retry=QUICK) as cluster:
            assert [n.name for n in cluster.nodes()] == ["a", "b"]
            assert "deltagym-cluster-refresh" in {t.get_name() for t in asyncio.all_tasks()}
            # b holds 3: a takes the first four (the fourth ties, by name), then b one.
            hs = [await cluster.reset("shell", timeout=10) for _ in range(5)]
            assert [node_of(h.id) for h in hs] == ["a", "a", "a", "a", "b"]
            async with await AsyncSandbox.create("shell", cluster=cluster) as sb:
                assert sb.client.node == "a" and (await sb.run("echo hi")).stdout == "hi\n"
                ck = await sb.checkpoint()
                kids = await AsyncSandbox.fork_from(ck, 2, cluster=cluster)
                assert len(kids) == 2 and {node_of(k.id) for k in kids} <= {"a", "b"}
                assert all(k.client is cluster.clients()[node_of(k.id)] for k in kids)
                for k in kids:
                    await k.close()
                kids = await AsyncSandbox.fork_from("ck-a-000000000000beef", 3, cluster=cluster)
                assert {node_of(k.id) for k in kids} == {"a"}
                for k in kids:
                    await k.close()
                again = await AsyncSandbox.connect(sb.id, cluster=cluster)
                assert again.client is sb.client
                await again.detach()
            a.service.draining, b.nodes.preloaded = True, 100
            await cluster.refresh()
            assert node_of((await cluster.reset("shell")).id) == "b"  # a was best, and drains
            a.service.draining = False
            a.stop()
            with pytest.raises(errors.NodeUnavailable) as ei:
                await hs[0].exec("echo hi")
            assert (ei.value.node, ei.value.address) == ("a", a.addr)
            assert [n.name for n in await cluster.refresh()] == ["b"]
            with pytest.raises(errors.NodeUnavailable, match="does not know"):
                await cluster.client_for("sb-zed-0123456789abcdef")
            with pytest.raises(ValueError, match="names no node"):
                await cluster.client_for("sb-0123456789abcdef")
        await cluster.close()
        await asyncio.sleep(0)
        assert {t.get_name() for t in asyncio.all_tasks()} - before == set()

    asyncio.run(main())


def test_async_resolver_may_be_a_coroutine() -> None:
    a, b = _on_one_port(["a", "b"], ["127.0.0.2", "127.0.0.3"])

    async def resolve(name: str) -> list[str]:
        assert name == "nodes.test"
        return ["127.0.0.3", "127.0.0.2", "127.0.0.3"]

    async def main() -> None:
        cluster = AsyncCluster(f"dns:nodes.test:{a.port}", token="t", refresh=REFRESH, resolver=resolve)
        assert cluster.nodes() == []  # no refresh before the first call that needs one
        h = await cluster.reset("shell")
        assert node_of(h.id) == "a" and [n.address for n in cluster.nodes()] == [a.addr, b.addr]
        await cluster.close()
        await cluster.close()

    try:
        asyncio.run(main())
    finally:
        a.stop()
        b.stop()


def test_a_name_two_nodes_report_goes_nowhere() -> None:
    """Nodes at two addresses that advertise different addresses but report one name (two nodes
    given one name, or one posing as another) get no calls on that name's IDs and no new
    sandboxes, each refused naming both addresses; once one is gone, the name serves again."""
    twin_a, twin_b, other = FakeServer("twin"), FakeServer("twin"), FakeServer("other")
    try:
        with deltagym.Cluster(_static([twin_a, twin_b, other]), token="t", refresh=REFRESH, heartbeat=False) as cluster:
            with pytest.raises(errors.NodeUnavailable, match="all report that name") as ei:
                cluster.client_for("sb-twin-0123456789abcdef")
            assert twin_a.addr in str(ei.value) and twin_b.addr in str(ei.value) and ei.value.node == "twin"
            for _ in range(3):
                assert node_of(cluster.reset("shell").id) == "other"
            twin_b.stop()
            cluster.refresh()
            assert cluster.client_for("sb-twin-0123456789abcdef").node == "twin"
    finally:
        for f in (twin_a, twin_b, other):
            f.stop()
