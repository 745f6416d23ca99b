"""What a launcher tells one process besides the run's spec (`asyncrl.launch.worker.ProcessRole`):
it goes on the worker's command line and comes back whole, a restart changes only its epoch,
and a server's epoch picks its key and what its heartbeats carry."""

from __future__ import annotations

import pytest

from asyncrl.launch.local import with_epoch
from asyncrl.launch.worker import ProcessRole, parse_args
from asyncrl.wire.auth import new_secret, role_key, server_role
from rollout_servers.replay_client import DEFAULT_HEARTBEAT_S, AsyncReplayClient


@pytest.mark.parametrize(
    "who",
    [
        ProcessRole("replay"),
        ProcessRole("learner"),
        ProcessRole("reward_model", 2),
        ProcessRole("server", 1),
        ProcessRole("server", 3, epoch=7),
    ],
)
def test_a_role_on_the_command_line_is_read_back_whole(who):
    assert parse_args(who.argv("run/launch.json")) == (who, "run/launch.json")


def test_names_and_refusals():
    assert [ProcessRole("server", 3, 7).name, ProcessRole("reward_model", 1).name] == [
        "server_3",
        "reward_model_1",
    ]
    assert ProcessRole("learner").name == "learner"
    with pytest.raises(ValueError, match="unknown role 'critic'"):
        ProcessRole("critic")
    with pytest.raises(ValueError, match="epoch -1"):
        ProcessRole("server", 0, epoch=-1)


def test_a_restart_changes_only_the_epoch_of_the_first_command():
    first = ["python", "-m", "asyncrl.launch.worker", *ProcessRole("server", 1).argv("s.json")]
    again = with_epoch(first, 2)
    assert again == [*first[:-1], "2"]
    assert parse_args(again[3:])[0] == ProcessRole("server", 1, epoch=2)


def test_the_heartbeats_carry_the_epoch_of_the_key_and_the_configured_interval():
    secret = new_secret()
    client = AsyncReplayClient(
        "tcp://127.0.0.1:1", role_key(secret, server_role(2, 3)), ack_timeout_s=1.0, heartbeat_s=0.3
    )
    try:
        assert (client.server_id, client.epoch, client.heartbeat_s) == (2, 3, 0.3)
    finally:
        client.close()
    first = AsyncReplayClient("tcp://127.0.0.1:1", role_key(secret, "server_0"), ack_timeout_s=1.0)
    try:
        assert (first.epoch, first.heartbeat_s) == (0, DEFAULT_HEARTBEAT_S)
    finally:
        first.close()
