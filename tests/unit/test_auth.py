"""The run secret and role keys: derivation, files, environment, and what a signature covers."""

import os
import stat

import pytest

from asyncrl.wire.auth import (
    KEY_ENV,
    SECRET_ENV,
    SYNC_KEY_ENV,
    AuthError,
    Keyring,
    RoleKey,
    auth_env,
    key_from_env,
    new_secret,
    read_secret,
    role_epoch,
    role_key,
    role_kind,
    server_index,
    server_role,
    sync_key,
    sync_key_from_env,
    write_secret,
)


def test_roles_have_distinct_keys_and_a_signature_covers_every_frame():
    secret = new_secret()
    keys = {role: role_key(secret, role) for role in ("learner", "server_0", "server_1", "client")}
    assert len({k.key for k in keys.values()}) == 4
    ring = Keyring(secret, num_servers=2)
    frames = [b"header", b"array-1", b"array-2"]
    auth = keys["server_1"].sign(frames)
    assert ring.verify(auth, frames) == "server_1"
    for tampered in (
        [b"header", b"array-1"],
        [b"header", b"array-1", b"array-2", b""],
        [b"header", b"array-2", b"array-1"],
        [b"headerarray-1", b"array-2"],  # moving a frame boundary changes the signature
    ):
        with pytest.raises(AuthError):
            ring.verify(auth, tampered)
    with pytest.raises(AuthError):  # a server's signature relabelled as the learner's
        ring.verify(b"learner:" + auth.partition(b":")[2], frames)
    with pytest.raises(AuthError):  # server_0 relabelled as server_1
        ring.verify(b"server_1:" + keys["server_0"].sign(frames).partition(b":")[2], frames)
    with pytest.raises(AuthError):  # a server the run does not have
        ring.verify(role_key(secret, "server_2").sign(frames), frames)
    with pytest.raises(AuthError):
        Keyring(new_secret(), num_servers=2).verify(auth, frames)
    for bad in ("server", "server_01", "server_-1", "root"):
        with pytest.raises(ValueError):
            role_key(secret, bad)
    assert "key" not in repr(keys["learner"]).replace("RoleKey", "")


def test_the_secret_file_is_private_and_read_back(tmp_path):
    secret = new_secret()
    path = write_secret(tmp_path, secret)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert read_secret(path) == secret == read_secret(tmp_path)
    (tmp_path / "bad").write_text("not hex")
    with pytest.raises(AuthError, match="hex"):
        read_secret(tmp_path / "bad")
    with pytest.raises(AuthError, match="cannot read"):
        read_secret(tmp_path / "missing")


def test_each_process_gets_only_its_own_key(monkeypatch):
    secret = new_secret()
    assert auth_env(secret, "replay") == {SECRET_ENV: secret.hex()}
    server_env = auth_env(secret, "server_3")
    assert set(server_env) == {KEY_ENV, SYNC_KEY_ENV}  # its epoch is on its command line
    assert secret.hex() not in server_env[KEY_ENV]
    learner_key = role_key(secret, "learner")
    assert server_env[SYNC_KEY_ENV] == sync_key(learner_key, "server_3").hex()
    assert learner_key.key.hex() not in server_env.values()  # its own join's key, not the learner's
    monkeypatch.setenv(SYNC_KEY_ENV, server_env[SYNC_KEY_ENV])
    assert sync_key_from_env() == sync_key(learner_key, "server_3")
    assert (
        auth_env(secret, "server_3", 2)[SYNC_KEY_ENV] == sync_key(learner_key, "server_3@2").hex()
    )
    monkeypatch.delenv(SECRET_ENV, raising=False)
    monkeypatch.setenv(KEY_ENV, server_env[KEY_ENV])
    assert key_from_env("server_3") == role_key(secret, "server_3")
    with pytest.raises(AuthError, match="holds the 'server_3' key"):
        key_from_env("learner")
    monkeypatch.setenv(KEY_ENV, auth_env(secret, "learner_1")[KEY_ENV])
    assert key_from_env("learner") == role_key(secret, "learner")
    monkeypatch.delenv(KEY_ENV)
    with pytest.raises(AuthError, match="neither"):
        key_from_env("learner")
    monkeypatch.setenv(SECRET_ENV, secret.hex())
    assert key_from_env("client") == role_key(secret, "client")
    assert os.environ[SECRET_ENV] == secret.hex()


def test_each_server_epoch_has_its_own_key_that_only_the_secret_makes(monkeypatch):
    """Restart e of server i gets the key of `server_i@e` (epoch 0 keeps `server_i`'s), which
    the replay derives and checks; no other epoch's key can be had from it."""
    secret = new_secret()
    assert [server_role(3, e) for e in (0, 1, 7)] == ["server_3", "server_3@1", "server_3@7"]
    assert role_kind("server_3@7") == "server" and server_index("server_3@7") == 3
    assert role_epoch("server_3@7") == 7 and role_epoch("server_3") == role_epoch("learner") == 0
    for bad in ("server_3@0", "server_3@07", "server_3@", "server_3@x", "client@1", "server_3@²"):
        with pytest.raises(ValueError):
            role_kind(bad)
    env = auth_env(secret, "server_3", epoch=7)
    assert env[KEY_ENV].startswith("server_3@7:")
    monkeypatch.delenv(SECRET_ENV, raising=False)
    monkeypatch.setenv(KEY_ENV, env[KEY_ENV])
    key = key_from_env(server_role(3, 7))  # the epoch from its command line names its role
    assert key == role_key(secret, "server_3@7") != role_key(secret, "server_3")
    for other in (0, 8):  # an epoch the launcher did not hand this key for
        with pytest.raises(AuthError, match="holds the 'server_3@7' key"):
            key_from_env(server_role(3, other))
    keyring = Keyring(secret, num_servers=4)
    frames = [b"heartbeat"]
    assert keyring.verify(key.sign(frames), frames) == "server_3@7"
    forged = RoleKey("server_3@8", key.key)  # epoch 7's key, claiming epoch 8
    with pytest.raises(AuthError, match="not signed with the server_3@8 key"):
        keyring.verify(forged.sign(frames), frames)
    with pytest.raises(AuthError, match="no known role"):  # no server 4 in this run
        keyring.verify(role_key(secret, "server_4@1").sign(frames), frames)
