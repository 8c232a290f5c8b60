"""Bearer-token auth against a server started with --token, and against one
that generated its own. This module runs first (its name sorts first): its
servers must not overlap the main one."""

from __future__ import annotations

import grpc
import pytest

import deltagym
from deltagym import Client

from .conftest import TOKEN, _serve


def test_token_auth(token_server, monkeypatch):
    with Client(token_server.addr, token="") as c:
        with pytest.raises(deltagym.Unauthenticated) as ei:
            c.list_envs()
        assert ei.value.code == grpc.StatusCode.UNAUTHENTICATED
    with Client(token_server.addr, token="wrong") as c, pytest.raises(deltagym.Unauthenticated):
        c.list_envs()
    with Client(token_server.addr, token=TOKEN) as c:
        assert c.list_envs() == []
    monkeypatch.setenv("DELTAGYM_TOKEN", TOKEN)
    with Client(token_server.addr) as c:
        assert c.list_envs() == []



def _clear_token_env(monkeypatch):
    for k in ("DELTAGYM_TOKEN", "DELTAGYM_TOKEN_FILE", "DELTAGYM_DATA"):
        monkeypatch.delenv(k, raising=False)


def test_generated_token(built, tmp_path, monkeypatch):
    """Without --token the server writes a token to <data>/token (0600), and
    the client finds it: $DELTAGYM_TOKEN, then $DELTAGYM_TOKEN_FILE, then the
    data directory's file ($DELTAGYM_DATA, else .data here or above)."""
    import os
    import stat

    with _serve(built, {}, [], False) as s:
        path = s.data / "token"
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        token = path.read_text().strip()
        assert len(token) >= 32
        _clear_token_env(monkeypatch)
        monkeypatch.chdir(tmp_path)  # no .data here: no token found
        with Client(s.addr) as c:
            with pytest.raises(deltagym.Unauthenticated) as ei:
                c.list_envs()
            assert "found no token" in ei.value.message and str(tmp_path / ".data" / "token") in ei.value.message
        monkeypatch.setenv("DELTAGYM_DATA", str(s.data))
        with Client(s.addr) as c:
            assert c.list_envs() == []
        monkeypatch.delenv("DELTAGYM_DATA")
        (tmp_path / ".data").mkdir()
        (tmp_path / ".data" / "token").write_text(token + "\n")
        with Client(s.addr) as c:  # ./.data/token
            assert c.list_envs() == []
        monkeypatch.setenv("DELTAGYM_TOKEN_FILE", str(tmp_path / "missing"))
        with pytest.raises(OSError):
            Client(s.addr)
        other = tmp_path / "other"
        other.write_text("wrong-token\n")
        monkeypatch.setenv("DELTAGYM_TOKEN_FILE", str(other))
        with Client(s.addr) as c:  # the named file comes before the data directory's
            with pytest.raises(deltagym.Unauthenticated) as ei:
                c.list_envs()
            assert "found no token" not in ei.value.message
        monkeypatch.setenv("DELTAGYM_TOKEN", token)
        with Client(s.addr) as c:  # the variable comes before the file
            assert c.list_envs() == []
