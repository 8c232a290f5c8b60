"""What Sandbox and AsyncSandbox share that does no I/O: the handle's
state, the setup context and the bookkeeping of a step's answer."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Generic, Protocol, TypeVar

from . import _ops as ops
from ._common import observation_text
from ._proto.deltagym.v1 import action_pb2, env_service_pb2 as es
from .errors import ProcessEnded, SandboxClosed
from .types import CommandResult


class Handle(Protocol):
    """The low-level handle's state a Sandbox reads (SandboxHandle, AsyncSandboxHandle)."""

    id: str
    env: str
    episode_id: str
    lease_expires_at: float | None
    reset_response: es.ResetResponse | None


H = TypeVar("H", bound=Handle)


class SandboxBase(Generic[H]):
    """The state of a Sandbox or AsyncSandbox, read from its handle."""

    _h: H
    _closed: bool
    timeout: float | None

    @property
    def id(self) -> str:
        """The sandbox ID."""
        return self._h.id

    @property
    def env(self) -> str:
        """The env's catalog name."""
        return self._h.env

    @property
    def episode_id(self) -> str:
        """The current episode."""
        return self._h.episode_id

    @property
    def lease_expires_at(self) -> float | None:
        """When the lease runs out (Unix seconds) by the last answer seen, None when unknown."""
        return self._h.lease_expires_at

    @property
    def observation(self) -> str:
        """The first observation as an agent reads it: the task and the
        output of the env's reset hook (where an env such as the built-in
        shell prints the task's particulars); "" for a sandbox that was
        connected to or forked."""
        r = self._h.reset_response
        return observation_text(r.observation) if r is not None else ""

    @property
    def handle(self) -> H:
        """The low-level handle, whose calls return the server's messages."""
        return self._h

    def __repr__(self) -> str:
        return f"{type(self).__name__}(id={self.id!r}, env={self.env!r}, episode_id={self.episode_id!r})"

    def setup(self) -> ops.SetupContext:
        """Marks every call on this sandbox inside the `with` (or `async
        with`) block as a setup step: recorded in the ledger, counted
        against neither max_steps nor max_seconds. It holds for this
        thread or asyncio task (and tasks started inside), not for others.
        A method's setup= argument overrides it; submit is never a setup
        step."""
        return ops.SetupContext(self.id)

    def _setup(self, setup: bool | None) -> bool:
        return ops.is_setup(self._h.id, setup)

    def _deadline(self, timeout: float | None) -> float | None:
        """A call's deadline (timeout, else the sandbox's); SandboxClosed once this sandbox is closed."""
        if self._closed:
            raise self._closed_error()
        return ops.deadline(timeout, self.timeout)

    def _command_deadline(self, timeout: float | None) -> float | None:
        """A command's call deadline (its timeout plus a margin, else the sandbox's)."""
        if self._closed:
            raise self._closed_error()
        return ops.command_deadline(timeout, self.timeout)

    def _closed_error(self) -> SandboxClosed:
        return SandboxClosed(f"sandbox {self.id} was closed (or detached) by this client", method="",
                             reason="SANDBOX_CLOSED", metadata={"sandbox_id": self.id})

    def _saw_step(self, resp: es.StepResponse) -> None:
        self._h.episode_id = resp.episode_id or self._h.episode_id


class ProcessBase:
    """What Process and AsyncProcess share that does no I/O: what the steps
    said of the process, and the actions that talk to it.

    Attributes:
        pid: its pid inside the sandbox (0 for an interactive one, which lives in its session).
        session: the session of an interactive process, else "".
        result: the result of the step that started it.
        expect: the patterns given to processes.start, which send and interrupt wait for by default.
    """

    def __init__(self, pid: int, session: str, result: CommandResult, expect: Sequence[str] = ()) -> None:
        self.pid = pid
        self.session = session
        self.result = result
        self.expect = tuple(expect)
        self._last = result
        self._killed = False

    def __repr__(self) -> str:
        return f"Process(pid={self.pid}, session={self.session!r}, running={self.running})"

    @property
    def running(self) -> bool:
        """Whether the process runs, as far as this client saw: for an
        interactive process, whether the last step that talked to it
        (start, send, interrupt) left it attached to its session; for a
        background one, until its kill() sent SIGKILL (processes.list()
        tells what the sandbox runs)."""
        if self.session:
            return self._last.running
        return not self._killed

    def _send_action(self, text: str, expect: Sequence[str] | None, timeout: float | None) -> action_pb2.Action:
        if not self.session:
            raise ValueError("send needs an interactive process (processes.start(..., stdin=True))")
        if not self._last.running:
            raise ProcessEnded(self.session, self._last)
        return ops.interactive_action(self.session, text, expect=self.expect if expect is None else expect,
                                      timeout=timeout)

    def _interrupt_action(self, expect: Sequence[str] | None, timeout: float | None) -> action_pb2.Action:
        # An ended program's session may run another's by now (a later start in the same
        # session): its Ctrl-C is not this handle's to send.
        if not self._last.running:
            raise ProcessEnded(self.session, self._last)
        return ops.interactive_action(self.session, "", expect=self.expect if expect is None else expect,
                                      timeout=timeout, interrupt=True)

    def _saw(self, r: CommandResult) -> CommandResult:
        self._last = r
        return r
