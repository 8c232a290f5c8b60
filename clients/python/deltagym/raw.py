"""The generated protobuf and gRPC modules, for power users: the escape
hatch below the typed API. `deltagym.raw.action_pb2.Action(...)` builds any
action, `deltagym.Client` sends it and returns the messages as they are.

    from deltagym import Client, raw
    with Client() as c, c.reset("shell") as h:
        resp: raw.env_service_pb2.StepResponse = h.step(raw.action_pb2.Action(
            list_dir=raw.action_pb2.ListDirAction(path="/work")))
"""

from ._proto.deltagym.v1 import (
    action_pb2,
    env_pb2,
    env_service_pb2,
    env_service_pb2_grpc,
    ledger_service_pb2,
    ledger_service_pb2_grpc,
)

__all__ = ["action_pb2", "env_pb2", "env_service_pb2", "env_service_pb2_grpc", "ledger_service_pb2",
           "ledger_service_pb2_grpc"]
