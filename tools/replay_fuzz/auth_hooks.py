"""Signing what the fuzzer sends, for a replay that authenticates every message.

When the checkout has `asyncrl.wire.auth` (an HMAC authentication frame before every message, one
key per role), a campaign makes a run secret, gives it to the replay process, and uses:

- `sign` for its own traffic (the stats it reads, the round trip): each message signed with the
  key of a role allowed to send its type (`replay.access.PERMISSIONS` where it exists);
- `sign_or_forge` for fuzz traffic: signed the same way, so that mutated messages get past the
  authentication to the decoder and the handlers, except one in ten, whose authentication
  frame is itself hostile (missing, empty, garbage, too long, an unknown role, a role not
  allowed to send the type, a signature over other frames, a flipped bit);
- `unwrap` on every answer: checks and strips the replay's authentication frame (empty on the
  unsigned `Error` an unauthenticated peer gets).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import msgpack

from asyncrl.wire import auth
from asyncrl.wire.auth import SECRET_ENV
from asyncrl.wire.codec import registered_types
from asyncrl.wire.validation import ProtocolError
from replay.access import PERMISSIONS

from .clients import Frames, Hook

FORGERIES = ["none", "empty", "garbage", "long", "unknown role", "wrong role", "other", "flip"]


class Signer:
    """Role keys of one run secret, and the hooks that use them (see the module docstring)."""

    def __init__(self, secret: bytes, rng: random.Random, servers: int) -> None:
        roles = ["learner", "client", *(f"server_{i}" for i in range(servers))]
        self.keys = {role: auth.role_key(secret, role) for role in roles}
        self.rng = rng
        self.permissions: dict[str, Any] = PERMISSIONS
        self.forgeries: dict[str, int] = dict.fromkeys(FORGERIES, 0)

    def _roles(self, frames: Frames) -> tuple[list[str], list[str]]:
        """(roles allowed to send this message's type, the others): for a message carrying a
        server_id, the key of that server (a server speaks only for itself)."""
        try:
            header = msgpack.unpackb(frames[0])
            cls = registered_types().get(header["type"])
            server_id = header["fields"].get("server_id")
        except Exception:  # a header mutated past reading: any role will do
            cls, server_id = None, None
        allowed = [r for r in self.keys if cls in self.permissions.get(auth.role_kind(r), ())]
        if type(server_id) is int and f"server_{server_id}" in allowed:
            allowed = [f"server_{server_id}"]
        return allowed or sorted(self.keys), [r for r in self.keys if r not in allowed]

    def _signed(self, frames: Frames, role: str) -> Frames:
        return [self.keys[role].sign(frames), *frames]

    def sign(self, frames: Frames) -> Frames:
        return self._signed(frames, self.rng.choice(self._roles(frames)[0]))

    def sign_or_forge(self, frames: Frames) -> Frames:
        if self.rng.random() >= 0.1:
            return self.sign(frames)
        allowed, others = self._roles(frames)
        kind = self.rng.choice(FORGERIES)
        self.forgeries[kind] += 1
        mac = self.keys[allowed[0]].sign(frames)
        forged: dict[str, Callable[[], Frames]] = {
            "none": lambda: frames,
            "empty": lambda: [b"", *frames],
            "garbage": lambda: [self.rng.randbytes(self.rng.randint(1, 64)), *frames],
            "long": lambda: [mac + bytes(64), *frames],
            "unknown role": lambda: [b"root:" + mac.partition(b":")[2], *frames],
            "wrong role": lambda: self._signed(frames, self.rng.choice(others or allowed)),
            "other": lambda: [self.keys[allowed[0]].sign([*frames, b"x"]), *frames],
            "flip": lambda: [mac[:-1] + bytes([mac[-1] ^ 1]), *frames],
        }
        return forged[kind]()

    def unwrap(self, frames: Frames) -> Frames:
        """An answer without its authentication frame; ProtocolError if that frame is wrong."""
        auth_frame, rest = frames[0], frames[1:]
        if auth_frame:  # empty: the unsigned Error of a peer that could not be authenticated
            role = auth_frame.partition(b":")[0].decode("ascii", "replace")
            if role not in self.keys or auth_frame != self.keys[role].sign(rest):
                raise ProtocolError(f"an answer with a bad authentication frame (role {role!r})")
        return rest


def setup_auth(seed: int, servers: int) -> tuple[Hook, Hook, Hook, dict[str, str]]:
    """(prepare for the campaign's own messages, prepare for fuzz messages, unwrap, environment
    of the replay process): signing hooks for a run of `servers` servers, and its secret."""
    secret = random.Random(f"{seed}/secret").randbytes(32)
    signer = Signer(secret, random.Random(f"{seed}/auth"), servers)
    return signer.sign, signer.sign_or_forge, signer.unwrap, {SECRET_ENV: secret.hex()}
