"""Tree search over checkpoints: expand children of a state by trying
actions from its checkpoint, score them, and backtrack to any node.

    tree = SearchTree(sandbox)                 # root = checkpoint of now
    kids = tree.expand(tree.root, ["make", "make -j2"])
    leaf = tree.select()                       # UCT descent to a leaf
    tree.backpropagate(leaf, tree.evaluate(leaf))
    tree.backtrack(tree.best_leaf())           # sandbox is at that state again

Every node holds a checkpoint; backtracking is a Restore (about a
millisecond on the server), so one sandbox serves the whole search.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from . import _common as c
from ._proto.deltagym.v1 import action_pb2, env_service_pb2 as es
from .actions import coerce
from .client import SandboxHandle
from .sandbox import Sandbox

__all__ = ["Node", "SearchTree"]


@dataclass(eq=False)
class Node:
    """A state of the search: the checkpoint after `action` from `parent`."""

    checkpoint_id: str
    parent: Node | None = None
    action: action_pb2.Action | None = None
    observation: str = ""
    reward: float = 0.0
    terminated: bool = False
    truncated: bool = False
    depth: int = 0
    children: list[Node] = field(default_factory=list)
    visits: int = 0
    value_sum: float = 0.0

    @property
    def value(self) -> float:
        """The mean backed-up value (0 before any visit)."""
        return self.value_sum / self.visits if self.visits else 0.0

    @property
    def done(self) -> bool:
        return self.terminated or self.truncated

    def path(self) -> list[Node]:
        """The nodes from the root to this one."""
        out: list[Node] = []
        n: Node | None = self
        while n is not None:
            out.append(n)
            n = n.parent
        return out[::-1]


class SearchTree:
    """A search tree over one sandbox's checkpoints.

    Args:
        sandbox: the sandbox to search in; the root is a checkpoint of its
            current state (or root_checkpoint_id when given).
        exploration: the UCT exploration constant.
    """

    def __init__(
        self, sandbox: SandboxHandle | Sandbox, *, root_checkpoint_id: str | None = None, exploration: float = 1.4
    ) -> None:
        self.sandbox: SandboxHandle = sandbox.handle if isinstance(sandbox, Sandbox) else sandbox
        self.exploration = exploration
        ck = root_checkpoint_id or self.sandbox.checkpoint().checkpoint_id
        self.root = Node(checkpoint_id=ck)
        self._own = [] if root_checkpoint_id else [ck]
        self.current: Node = self.root

    def nodes(self) -> Iterator[Node]:
        """Every node, parents before children."""
        stack = [self.root]
        while stack:
            n = stack.pop()
            yield n
            stack.extend(reversed(n.children))

    def backtrack(self, node: Node) -> None:
        """Puts the sandbox at node's state (no call when already there)."""
        if self.current is not node:
            self.sandbox.restore(node.checkpoint_id)
            self.current = node

    def expand(self, node: Node, actions: Iterable[action_pb2.Action | str]) -> list[Node]:
        """Tries each action from node's state and adds a child per action,
        checkpointed after the step. A str is a shell command."""
        kids = []
        for a in actions:
            self.backtrack(node)
            act = coerce(a)
            resp: es.StepResponse = self.sandbox.step(act, checkpoint=True)
            kid = Node(checkpoint_id=resp.checkpoint_id, parent=node, action=act,
                       observation=c.observation_text(resp.observation), reward=resp.reward,
                       terminated=resp.terminated, truncated=resp.truncated, depth=node.depth + 1)
            self._own.append(resp.checkpoint_id)
            node.children.append(kid)
            self.current = kid
            kids.append(kid)
        return kids

    def evaluate(self, node: Node) -> float:
        """The verifier's reward at node's state (terminal nodes: their step reward)."""
        if node.terminated:
            return node.reward
        self.backtrack(node)
        return self.sandbox.evaluate().reward

    def backpropagate(self, node: Node, value: float) -> None:
        """Adds value to the node and each ancestor."""
        n: Node | None = node
        while n is not None:
            n.visits += 1
            n.value_sum += value
            n = n.parent

    def select(self, node: Node | None = None) -> Node:
        """Descends from node (default the root) by UCT to a leaf."""
        n = node or self.root
        while n.children:
            n = max(n.children, key=lambda k: self._uct(n, k))
        return n

    def _uct(self, parent: Node, kid: Node) -> float:
        if kid.visits == 0:
            return math.inf
        return kid.value + self.exploration * math.sqrt(math.log(max(parent.visits, 1)) / kid.visits)

    def best_leaf(self, key: Callable[[Node], Any] | None = None) -> Node:
        """The leaf with the highest key (default: value, then reward)."""
        k = key or (lambda n: (n.value, n.reward))
        return max((n for n in self.nodes() if not n.children), key=k)

    def release(self) -> None:
        """Releases every checkpoint the tree took."""
        for ck in self._own:
            self.sandbox.client.release_checkpoint(ck)
        self._own = []
