"""verifiers 0.4.0's `openenv` taskset, unchanged, against a deltagym env served at /openenv/{env}.

Usage: python verifiers040.py BASE_URL [TOKEN]   (BASE_URL like http://127.0.0.1:PORT/openenv/shell)

The env is loaded the way `vf eval openenv` loads it (the taskset id "openenv", its Env class,
its tasks from `resets`) with `base_url` pointing at deltagym (the taskset's client sends no
headers: the token travels in the /t/<token>/ prefix). The taskset's own rollout loop
(OpenEnvEnv.run: GET /schema, reset, then one step per model reply until done) runs with a
scripted stand-in for the model: the player's interaction answers each turn with a scripted
reply and checks the observation the loop showed it. The real model path would run a harness
program that installs unpinned packages at run time. Prints one JSON line; exits 1 on any
mismatch.
"""

import asyncio
import contextlib
import json
import types

from verifiers.v1.agent import Segment
from verifiers.v1.tasksets.openenv import OpenEnvConfig, OpenEnvEnv, OpenEnvEnvConfig
from verifiers.v1.types import AssistantMessage
from verifiers.v1.utils.loaders import environment_class

from oecommon import SCRATCH, Mismatch, Report, args, check, ids, number, prefixed

F = SCRATCH + "/oe_vf.txt"
MCP_TITLES = {"Action", "CallToolAction", "ListToolsAction"}


def first_turn(seen):
    schema = seen["action_schema"]
    check(schema.get("title") not in MCP_TITLES, "schema: the action is not OpenEnv's generic MCP action", schema)
    check(schema.get("required") == ["command"], "schema: command is the one required field", schema)
    ids(seen["observation"])
    return "echo hello-vf"  # plain text: parse_action makes it {"command": ...}


def second_turn(seen):
    obs = seen["observation"]
    check(obs.get("stdout") == "hello-vf\n", "a plain-text reply ran as a command", obs)
    return "```json\n" + json.dumps({"command": "", "write_file": {"path": F, "content": "vf"}}) + "\n```"


def third_turn(seen):
    obs = seen["observation"]
    check(obs.get("metadata", {}).get("terminated") is False, "a fenced JSON reply is an action object", obs)
    return "cat " + F


def fourth_turn(seen):
    obs = seen["observation"]
    check(obs.get("stdout") == "vf", "the file the JSON action wrote", obs)
    return "submit"  # the submit command ends the episode: done, so the loop stops


SCRIPT = [first_turn, second_turn, third_turn, fourth_turn]


class StandInTrace:
    """The part of a verifiers Trace the loop writes to."""

    def __init__(self):
        self.rewards = {}
        self.stop_condition = None

    def record_reward(self, name, value, weight=1.0):
        self.rewards[name] = (float(value), float(weight))

    def stop(self, condition, override=False):
        if override or self.stop_condition is None:
            self.stop_condition = condition


class ScriptedInteraction:
    """Answers each turn with the next scripted reply, after checking what the loop sent."""

    def __init__(self, report):
        self.trace = StandInTrace()
        self.turns = 0
        self.sandbox = None
        self.report = report

    async def turn(self, message=None):
        check(isinstance(message, str), "the loop sends each turn as text", message)
        seen = json.loads(message)
        check(set(seen) == {"observation", "action_schema"}, "a turn holds the observation and the schema", seen)
        sid = self.report.saw(seen["observation"])
        check(self.sandbox in (None, sid), "one sandbox for the whole rollout", sid)
        self.sandbox = sid
        if self.turns >= len(SCRIPT):
            raise Mismatch("the loop asked for turn %d after the episode should have ended" % (self.turns + 1))
        reply = SCRIPT[self.turns](seen)
        self.turns += 1
        return Segment(messages=[AssistantMessage(content=reply)])


class ScriptedPlayer:
    def __init__(self, report):
        self.report = report
        self.interactions = []

    @contextlib.asynccontextmanager
    async def interaction(self, task):
        it = ScriptedInteraction(self.report)
        self.interactions.append(it)
        yield it


async def rollouts(r, base):
    config = OpenEnvEnvConfig(taskset=OpenEnvConfig(id="openenv", base_url=base, resets=[{}, {"seed": 7}]))
    env_cls = environment_class("openenv")
    check(env_cls is OpenEnvEnv, "the openenv taskset's Env", env_cls)
    env = env_cls(config)
    tasks = list(env.taskset.load())
    check(len(tasks) == 2, "one task per reset", len(tasks))
    r.ok("taskset loaded from base_url")
    player = ScriptedPlayer(r)
    for task in tasks:
        await env.run(task, types.SimpleNamespace(player=player))
    for it in player.interactions:
        check(it.turns == len(SCRIPT), "each rollout took every scripted turn and ended on done", it.turns)
        check(it.trace.stop_condition is None, "the rollout ended by the episode, not a stop", it.trace.stop_condition)
        reward = it.trace.rewards.get("openenv_reward")
        check(reward is not None and number(reward[0]), "the summed OpenEnv reward is recorded", it.trace.rewards)
    r.ok("rollout loop: plain text, fenced JSON and submit replies, to done")


def main(r):
    url, token = args(r)
    asyncio.run(rollouts(r, prefixed(url, token)))


if __name__ == "__main__":
    Report("verifiers 0.4.0 (openenv 0.4.1)").run(main)
