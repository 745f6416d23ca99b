"""Who may talk to a run: a secret made at launch, one key per role, an HMAC on every message.

The launcher makes a random 32-byte run secret and writes it to `run_dir/run.secret` (mode
0600). From it each role gets its own key, `HMAC-SHA256(secret, "asyncrl role <role>")`:

    learner     may take batches, publish versions, ask for checkpoints, evaluate, read stats
    server_<i>  rollout server i: may lease prompts and send trajectories as server i (the
                replay checks the server_id they carry), read stats; its restart e (e >= 1)
                gets the key of `server_<i>@<e>` instead, the only key whose heartbeats may
                carry epoch e
    client      may evaluate and read stats (`asyncrl eval`, the launcher's progress, tools)

A process gets only what it needs, in its environment (never on its command line, which any
user can read in /proc/<pid>/cmdline, nor in run_dir/launch.json): the replay gets the run
secret (it checks every role); a learner rank or a rollout server gets its role's key.
`asyncrl eval --address` reads the secret from `--run-dir` or `--secret-file`. These secrets
are the only values of our own that travel in the environment (docs/architecture.md,
"Environment variables: the process boundary only"); a server's epoch, which names its role,
comes on its command line (`asyncrl.launch.worker`) and picks the key it expects
(`key_from_env`).

The weight-sync joins, on learner rank 0's TCPStore (which torch cannot authenticate), are
sealed with a sync key per server epoch, `HMAC-SHA256(learner key, "asyncrl weight sync
<role>")` (`sync_key`): learner rank 0 derives it for any member; restart e of server i is
handed the one of `server_<i>@<e>` beside its role key (`asyncrl.weights.sealed_store` says what that
protects and what it cannot).

Epochs only step forward from what the launcher started. A server's epoch (its restart count)
is bound to its key: the launcher, which holds the secret, hands restart e the key of
`server_<i>@<e>` (`auth_env`), and the replay takes a heartbeat's epoch only from a message
signed with that epoch's key (`replay.access`). A server process holds its own epoch's key and
no other, so it cannot forge a later epoch (a heartbeat with epoch 2**31-1 once locked its slot
out for good: every real restart after it was refused as older). Why keys and not a bound the
launcher tells the replay: nothing to keep in step (the launcher's notice and the server's first
heartbeat could arrive in either order), nothing to rebuild when the replay restarts, and no new
role for the launcher.

On the wire every message is preceded by one authentication frame:

    b"<role>:" + HMAC-SHA256(role key, "asyncrl-auth-v1" + for each frame: len (8 bytes) + bytes)

so a frame can be neither changed, dropped, added nor moved, and a message signed for one role
cannot be passed off as another's. Replies are signed with the key of the role that asked. A
message whose frame is missing or wrong is rejected and counted, and the only answer is an
unsigned `Error` saying so: a peer without the secret can neither read nor change anything.

Not covered (documented in docs/pipeline.md): a message captured on the wire could be sent
again (capturing loopback traffic needs root on the machine), and processes of one run share
one uid, so the role keys separate duties, they do not wall off a compromised run process.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

ROLES = ("learner", "server", "client")
"""The kinds of role; a server's role names its index, and its epoch from the first restart on:
`server_0`, `server_1`, `server_1@1`, ... (`server_role`)."""
SECRET_FILE = "run.secret"
SECRET_ENV = "ASYNCRL_RUN_SECRET"  # the run secret, hex (the replay; a user's shell)
KEY_ENV = "ASYNCRL_AUTH_KEY"  # "<role>:<key hex>" (a learner rank or a rollout server)
SYNC_KEY_ENV = "ASYNCRL_SYNC_KEY"  # a rollout server's weight-sync key, hex (`sync_key`)
_DOMAIN = b"asyncrl-auth-v1"
_MAC_BYTES = 32
MAX_AUTH_FRAME = 64


class AuthError(ValueError):
    """A message without a valid authentication frame, or no key where one is needed."""


@dataclass(frozen=True)
class RoleKey:
    """The key of one role: signs what this process sends, checks what it is sent back."""

    role: str
    key: bytes

    def __repr__(self) -> str:  # never print a key into a log
        return f"RoleKey(role={self.role!r})"

    def sign(self, frames: Sequence[bytes | memoryview]) -> bytes:
        """The authentication frame for message `frames`."""
        return self.role.encode() + b":" + _mac(self.key, self.role, frames)

    def check(self, auth_frame: bytes, frames: Sequence[bytes | memoryview]) -> None:
        """Raise AuthError unless `auth_frame` signs `frames` with this key."""
        if not hmac.compare_digest(auth_frame, self.sign(frames)):
            raise AuthError(f"message not signed with the {self.role} key of this run")


def _mac(key: bytes, role: str, frames: Sequence[bytes | memoryview]) -> bytes:
    h = hmac.new(key, _DOMAIN + role.encode() + b"\0", hashlib.sha256)
    for frame in frames:
        h.update(len(frame).to_bytes(8, "little"))
        h.update(frame)
    return h.digest()


def _number(text: str) -> bool:
    return text.isascii() and text.isdigit() and str(int(text)) == text


def role_kind(role: str) -> str:
    """learner | server | client: what `role` may do (`server_3`, `server_3@2` are servers)."""
    base, at, epoch = role.partition("@")
    kind, _, index = base.rpartition("_")
    if kind == "server" and _number(index) and (not at or (_number(epoch) and int(epoch) > 0)):
        return kind
    if role in ("learner", "client"):
        return role
    raise ValueError(f"unknown role {role!r}: learner, client or server_<index>[@<epoch>]")


def server_index(role: str) -> int | None:
    """The index of a `server_<i>` role (None for the other roles)."""
    return int(role.partition("@")[0].rpartition("_")[2]) if role_kind(role) == "server" else None


def role_epoch(role: str) -> int:
    """The server epoch whose key `role` names (`server_3@2`: 2; `server_3` and others: 0)."""
    role_kind(role)
    return int(role.partition("@")[2] or 0)


def server_role(index: int, epoch: int) -> str:
    """The role of epoch `epoch` of rollout server `index` (see the module docstring)."""
    return f"server_{index}" if epoch == 0 else f"server_{index}@{epoch}"


def role_key(secret: bytes, role: str) -> RoleKey:
    """The key of `role` (learner, client, server_<i>) derived from the run secret."""
    role_kind(role)
    return RoleKey(role, hmac.new(secret, b"asyncrl role " + role.encode(), "sha256").digest())


class Keyring:
    """Every role's key (the replay's view): tells which role signed a message."""

    def __init__(self, secret: bytes, num_servers: int) -> None:
        roles = ["learner", "client", *(f"server_{i}" for i in range(num_servers))]
        self._keys = {role: role_key(secret, role) for role in roles}
        self._secret, self._num_servers = secret, num_servers

    def key(self, role: str) -> RoleKey:
        """The key of `role`: one of this run's, or a later epoch of one of its servers
        (derived when asked: a few microseconds, nothing kept); KeyError for any other."""
        if role in self._keys:
            return self._keys[role]
        try:
            index = server_index(role)
        except ValueError:
            raise KeyError(role) from None
        if index is None or index >= self._num_servers:
            raise KeyError(role)
        return role_key(self._secret, role)

    def verify(self, auth_frame: bytes, frames: Sequence[bytes | memoryview]) -> str:
        """The role whose key signed `frames`; AuthError if none did."""
        if not auth_frame:
            raise AuthError("no authentication frame (is the run secret configured?)")
        if len(auth_frame) > MAX_AUTH_FRAME:
            raise AuthError(f"authentication frame of {len(auth_frame)} bytes")
        role = auth_frame.partition(b":")[0].decode("ascii", "replace")
        try:
            key = self.key(role)
        except KeyError:
            raise AuthError("authentication frame names no known role") from None
        key.check(auth_frame, frames)
        return role


def sync_key(learner: RoleKey, server: str) -> bytes:
    """The key that seals server epoch `server`'s weight-sync join (`server_3@1`; see
    `asyncrl.weights.sealed_store`): derived from the learner's key, so learner rank 0 computes it for
    any member it joins, while a server process is handed its own epoch's and no other."""
    if learner.role != "learner" or role_kind(server) != "server":
        raise ValueError(f"a sync key is the learner's for a server, not {learner.role}/{server}")
    return hmac.new(learner.key, b"asyncrl weight sync " + server.encode(), "sha256").digest()


def sync_key_from_env() -> bytes:
    """A rollout server's weight-sync key, from $ASYNCRL_SYNC_KEY (set by the launcher)."""
    text = os.environ.get(SYNC_KEY_ENV)
    if not text:
        raise AuthError(f"${SYNC_KEY_ENV} is not set: start the server with `asyncrl launch`")
    return _parse_hex(text, f"${SYNC_KEY_ENV}")


def new_secret() -> bytes:
    return secrets.token_bytes(32)


def write_secret(run_dir: str | Path, secret: bytes) -> Path:
    """Write the run secret to `run_dir/run.secret`, readable by its owner only."""
    path = Path(run_dir) / SECRET_FILE
    tmp = path.with_name(f".{SECRET_FILE}.{os.getpid()}.{secrets.token_hex(4)}")
    # a new file, never one planted there (nor a link to one) by whoever else can write here
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secret.hex() + "\n")
    os.replace(tmp, path)
    return path


def read_secret(path: str | Path) -> bytes:
    """The run secret from a file written by `write_secret` (or a run directory holding one)."""
    path = Path(path)
    if path.is_dir():
        path = path / SECRET_FILE
    try:
        return _parse_hex(path.read_text().strip(), str(path))
    except OSError as e:
        raise AuthError(f"cannot read the run secret: {e}") from None


def _parse_hex(text: str, source: str) -> bytes:
    try:
        secret = bytes.fromhex(text)
    except ValueError:
        raise AuthError(f"{source} does not hold a hex run secret") from None
    if len(secret) < 16:
        raise AuthError(f"{source}: a run secret has at least 16 bytes, got {len(secret)}")
    return secret


def secret_from_env() -> bytes:
    """The run secret from $ASYNCRL_RUN_SECRET (the replay's environment)."""
    text = os.environ.get(SECRET_ENV)
    if not text:
        raise AuthError(f"${SECRET_ENV} is not set: start the replay with `asyncrl launch/serve`")
    return _parse_hex(text, f"${SECRET_ENV}")


def key_from_env(role: str) -> RoleKey:
    """The key of `role`, this process's: from $ASYNCRL_AUTH_KEY, or derived from
    $ASYNCRL_RUN_SECRET. A server names the role of its epoch (`server_role(index, epoch)`,
    the epoch from its command line), so a key handed for another epoch is refused."""
    role_kind(role)
    text = os.environ.get(KEY_ENV)
    if not text:
        if os.environ.get(SECRET_ENV):
            return role_key(secret_from_env(), role)
        raise AuthError(f"neither ${KEY_ENV} nor ${SECRET_ENV} is set: no key to talk to the run")
    got, _, key_hex = text.partition(":")
    if got != role:
        raise AuthError(f"${KEY_ENV} holds the {got!r} key, this process needs the {role!r} key")
    return RoleKey(role, _parse_hex(key_hex, f"${KEY_ENV}"))


def auth_env(secret: bytes, process: str, epoch: int = 0) -> dict[str, str]:
    """What a fleet process named `process` (replay, reward_model_<i>, server_<i>,
    learner_<rank>) gets in its environment: the run secret for the replay and the reward-model
    servers (they check every role's key), its role's key for the others (a server's: that of
    its `epoch`, with its weight-sync key: `sync_key`; see the module docstring). The epoch
    itself is no secret: it goes on the server's command line (`asyncrl.launch.worker`)."""
    if process == "replay" or process.startswith("reward_model_"):
        return {SECRET_ENV: secret.hex()}
    if process.startswith("server_"):
        role = server_role(int(process.rpartition("_")[2]), epoch)
        sync = sync_key(role_key(secret, "learner"), role).hex()
        own = role_key(secret, role).key.hex()
        return {KEY_ENV: f"{role}:{own}", SYNC_KEY_ENV: sync}
    role = process.rpartition("_")[0] or process
    key = role_key(secret, role)
    return {KEY_ENV: f"{role}:{key.key.hex()}"}
