"""Bearer-token auth against a server started with --token. This module runs
first (its name sorts first): its server must not overlap the main one."""

from __future__ import annotations

import grpc
import pytest

import deltagym
from deltagym import Client

from .conftest import TOKEN


def test_token_auth(token_server, monkeypatch):
    with Client(token_server.addr, token="") as c:
        with pytest.raises(deltagym.Unauthenticated) as ei:
            c.list_envs()
        assert ei.value.code == grpc.StatusCode.UNAUTHENTICATED
    with Client(token_server.addr, token="wrong") as c:
        with pytest.raises(deltagym.Unauthenticated):
            c.list_envs()
    with Client(token_server.addr, token=TOKEN) as c:
        assert c.list_envs() == []
    monkeypatch.setenv("DELTAGYM_TOKEN", TOKEN)
    with Client(token_server.addr) as c:
        assert c.list_envs() == []

