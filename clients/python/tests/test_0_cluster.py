"""The cluster client against two real nodes: servers named node-a and node-b on 127.0.0.2 and
127.0.0.3, one port, one token, found through a resolver as a headless Service's DNS name
would give them. Placement spreads by the nodes' reports, calls go to the node an ID names, a
draining node is passed over while its sandboxes run on, and a stopped node's sandboxes raise
NodeUnavailable while new work goes on. Its servers must not overlap the main one: this module
runs before it (its name sorts first), and its last test stops node-a."""

from __future__ import annotations

import contextlib
import re
import signal
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

import deltagym
from deltagym import Client, RetryPolicy, errors
from deltagym._common import DEFAULT_RETRY
from deltagym.cluster import node_of, spread
from deltagym.types import NodeInfo

from .conftest import SHELL_ENV, Server, _Built, _serve, free_port_on

TOKEN = "py-cluster-token"
IPS = {"node-a": "127.0.0.2", "node-b": "127.0.0.3"}
# Both nodes capped alike, so that a sandbox weighs the same on each and the machine's load
# (the same for both) decides nothing.
MAX_SANDBOXES = 24
POOL = 4
DRAIN = 10  # seconds node-a drains on SIGTERM before it shuts down


@dataclass
class Pair:
    nodes: dict[str, Server]
    port: int
    listed: list[str]  # what the resolver answers; a test changes it as DNS would

    def resolver(self, name: str) -> list[str]:
        assert name == "nodes.test"
        return list(self.listed)

    def cluster(self, retry: RetryPolicy = DEFAULT_RETRY) -> deltagym.Cluster:
        return deltagym.Cluster(f"dns:nodes.test:{self.port}", token=TOKEN, resolver=self.resolver, refresh=300,
                                retry=retry)


def _wait_warm(addr: str) -> None:
    with Client(addr, token=TOKEN, heartbeat=False) as c:
        deadline = time.monotonic() + 120
        while not any(e.spec.name == "shell" and e.warm_count >= POOL for e in c.list_envs()):
            if time.monotonic() > deadline:
                pytest.fail(f"env shell of {addr} not warm after 120s")
            time.sleep(0.1)


def _settled(cluster: deltagym.Cluster) -> list[NodeInfo]:
    """The nodes' reports once both count as many sandboxes (the ones closed before retired,
    the warm pools refilled), so that placement starts from a tie."""
    deadline = time.monotonic() + 60
    while True:
        reports = cluster.refresh()
        if len(reports) == 2 and reports[0].sandboxes == reports[1].sandboxes:
            return reports
        assert time.monotonic() < deadline, f"the nodes' sandboxes do not settle: {reports}"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def pair(built: _Built) -> Iterator[Pair]:
    port = free_port_on(*IPS.values())
    env = {"shell": dict(SHELL_ENV, pool_size=POOL)}
    with contextlib.ExitStack() as stack:
        nodes = {name: stack.enter_context(_serve(
            built, env, ["--token", TOKEN, "--node-name", name, "--max-sandboxes", str(MAX_SANDBOXES),
                         "--drain-timeout", f"{DRAIN}s", "--peers", ",".join(f"{x}:{port}" for x in IPS.values())],
            False, host=ip, port=port))
            for name, ip in IPS.items()}
        for s in nodes.values():
            _wait_warm(s.addr)
        yield Pair(nodes=nodes, port=port, listed=list(IPS.values()))


def test_spread_and_routing(pair: Pair) -> None:
    a, b = pair.nodes["node-a"], pair.nodes["node-b"]
    with pair.cluster() as cluster:
        reports = _settled(cluster)
        assert [(n.name, n.address, n.max_sandboxes) for n in reports] == [
            ("node-a", a.addr, MAX_SANDBOXES), ("node-b", b.addr, MAX_SANDBOXES)]
        assert all(n.version and not n.draining and n.cpus > 0 and n.memory_total > 0 for n in reports)
        # Eight sandboxes go where water-filling on the reports puts them: half on each node.
        want = spread(8, reports)
        assert sorted(want.values()) == [4, 4], want
        sbs = [deltagym.Sandbox.create("shell", cluster=cluster, timeout=60) for _ in range(8)]
        try:
            assert Counter(node_of(sb.id) for sb in sbs) == want
            # Each call goes to the node the ID names.
            for sb in sbs:
                assert sb.client.addr == pair.nodes[node_of(sb.id)].addr
                assert sb.run("echo $((6*7))").stdout == "42\n"
            on_b = next(sb for sb in sbs if node_of(sb.id) == "node-b")
            assert on_b.run("echo moved > /tmp/moved").ok
            ck = on_b.checkpoint()
            assert node_of(ck.id) == "node-b"
            # A fork spreads by load: node-a fetches node-b's checkpoint and forks it too.
            kids = deltagym.Sandbox.fork_from(ck, 4, cluster=cluster, timeout=60)
            assert len(kids) == 4 and {node_of(k.id) for k in kids} == {"node-a", "node-b"}
            for k in kids:
                assert k.run("cat /tmp/moved").stdout == "moved\n"
                k.close()
            again = deltagym.Sandbox.connect(on_b.id, cluster=cluster)
            assert again.client is on_b.client and again.describe().id == on_b.id
            again.detach()
            # The node that does not hold an ID says which does: what the cluster spares its callers.
            with Client(a.addr, token=TOKEN, heartbeat=False) as direct, pytest.raises(errors.WrongNode) as ei:
                direct.get_sandbox(on_b.id)
            assert ei.value.node == "node-b"
            # The reports count the leased sandboxes.
            held = {n.name: n.sandboxes for n in cluster.refresh()}
            assert held["node-a"] >= 4 and held["node-b"] >= 4, held
        finally:
            for sb in sbs:
                sb.close()


def test_readme_example(pair: Pair, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """The README's cluster example runs, with the nodes as a fixed list."""
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = text.split("\n## A cluster of nodes\n", 1)[1].split("\n## ", 1)[0]
    code = re.findall(r"^```python\n(.*?)^```$", section, re.DOTALL | re.MULTILINE)[0]
    target = '"dns:deltagym-nodes.default.svc:8080"'
    assert target in code
    monkeypatch.setenv("DELTAGYM_TOKEN", TOKEN)
    static = ",".join(s.addr for s in pair.nodes.values())
    exec(compile(code.replace(target, repr(static)), "README.md", "exec"), {"__name__": "readme"})  # the repository's own doc
    assert "('node-a', " in capsys.readouterr().out


def test_draining_then_stopped_node(pair: Pair) -> None:
    """Runs last: node-a drains, then stops."""
    a = pair.nodes["node-a"]
    with pair.cluster(retry=RetryPolicy(max_attempts=2, initial_backoff=0.05)) as cluster:
        _settled(cluster)
        sbs = [deltagym.Sandbox.create("shell", cluster=cluster, timeout=60) for _ in range(4)]
        on_a = [x for x in sbs if node_of(x.id) == "node-a"]
        assert len(on_a) == 2, [x.id for x in sbs]  # from a tie, placement alternates
        # SIGTERM: node-a drains. The cluster's last report still has it take sandboxes.
        assert a.proc is not None
        a.proc.send_signal(signal.SIGTERM)
        with Client(a.addr, token=TOKEN, heartbeat=False) as direct:
            deadline = time.monotonic() + 30
            while not direct.get_node().draining:
                assert time.monotonic() < deadline, "node-a does not drain"
                time.sleep(0.05)
        # Once node-a is the best node by the cluster's count (at once, or after one on
        # node-b), it refuses with DRAINING, and node-b takes the sandbox; the cluster takes
        # node-a for draining from then on.
        for _ in range(2):
            sbs.append(deltagym.Sandbox.create("shell", cluster=cluster, timeout=60))
            assert node_of(sbs[-1].id) == "node-b"
            if cluster.nodes()[0].draining:
                break
        else:
            pytest.fail("the cluster never tried node-a")
        assert [(n.name, n.draining) for n in cluster.nodes()] == [("node-a", True), ("node-b", False)]
        # The draining node's sandboxes run on; its pod leaves the DNS answers, and new work goes elsewhere.
        pair.listed.remove(IPS["node-a"])
        assert [n.name for n in cluster.refresh()] == ["node-b"]
        assert all(x.run("echo on").stdout == "on\n" for x in on_a)
        sbs.append(deltagym.Sandbox.create("shell", cluster=cluster, timeout=60))
        assert node_of(sbs[-1].id) == "node-b"
        # node-a stops (its drain ends): the calls on its sandboxes name it and its address.
        on_a[0].close()
        a.proc.wait(timeout=DRAIN + 60)
        with pytest.raises(errors.NodeUnavailable) as ei:
            on_a[1].run("echo gone")
        assert (ei.value.node, ei.value.address) == ("node-a", a.addr)
        assert f"node node-a ({a.addr}) is unavailable" in str(ei.value)
        # Work goes on on node-b.
        with deltagym.Sandbox.create("shell", cluster=cluster, timeout=60) as last:
            assert node_of(last.id) == "node-b" and last.run("echo still").stdout == "still\n"
        for x in sbs:
            if node_of(x.id) == "node-b":
                x.close()
