"""A weight-sync member's view of learner rank 0's TCPStore, every value sealed with its sync key.

torch's TCPStore takes any connection and has no access control: any local process can list
its keys, read them and write them. The weight-sync joins live there (`asyncrl.weights.group`):
a server epoch's `ready` (its place: hostname, boot id, /dev/shm, device), the learner's
`answer` (join over a transport, or abandon) and the gloo/NCCL rendezvous entries that tell the
two ends where to connect. Before this module a process without any key of the run read those
entries and, by pre-writing "abandon" answers for a server's next epochs, made every restart of
that server fail until the launcher dropped it for good.

Every value a member's group writes now goes through `SealedStore`, keyed by the member's sync
key (`asyncrl.wire.auth.sync_key`: derived from the learner's key for one server epoch, so learner
rank 0 can compute it for any member and a server process holds its own epoch's only):

    stored value = nonce (16 bytes) + ciphertext + tag (32 bytes)
    ciphertext   = value XOR HMAC-SHA256(enc key, nonce + counter) blocks   (a PRF in CTR mode)
    tag          = HMAC-SHA256(mac key, domain + full key name + nonce + ciphertext)

Encrypt-then-MAC with two keys derived from the sync key. The tag binds the full key name
(prefix included), so a value cannot be moved to another key, member or epoch; the nonce makes
two seals of one value differ. What a keyless process can still do, and what follows:
1. Read: it sees key names (`server_3/epoch_1/ready`) and ciphertext, never a place, an
   answer or a rendezvous address.
2. Forge or pre-write: a value that does not open is treated as absent. `check` is False,
   `wait` and `get` keep waiting for one that opens, so a forged `answer` (or a pre-written
   abandon) changes nothing, and the genuine write, which overwrites it, is the one taken.
3. Overwrite a genuine value: it then reads as absent until written again. A joining server
   writes its `ready` again every `REFRESH_S` while it waits (`asyncrl.weights.group`), so an
   overwrite costs a join a second, not the join. Deleting or overwriting without pause is a
   denial of service (the join times out and the run reports it, as for a server that never
   came); a process of the same uid can also kill the run's processes outright. The store
   guards what a join says, not that it happens.
4. Write a huge value: a value over `MAX_VALUE` bytes does not open, and is not hashed.
Integer counters (`add`) pass through unsealed: they carry no content of a join (a count is
all a rendezvous may keep in them), and a forged count can only stall it, as a deletion can.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import secrets
import time

import torch.distributed as dist

_DOMAIN = b"asyncrl-sealed-store-v1\0"
_NONCE = 16
_TAG = 32
MAX_VALUE = 1 << 20
"""The largest stored value that may open (a place, an answer and a rendezvous entry are a few
hundred bytes): a larger one is refused before it is hashed."""
POLL_S = 0.02
"""How often `wait` looks again for a value that opens."""


class SealedStore(dist.Store):
    """The keys under `prefix` of `store`, each value sealed with `key` (module docstring)."""

    def __init__(
        self, store: dist.Store, prefix: str, key: bytes, timeout: datetime.timedelta
    ) -> None:
        super().__init__()
        self._inner = dist.PrefixStore(prefix, store)
        self._prefix = prefix
        self._enc = hmac.new(key, b"asyncrl sealed store: encryption", "sha256").digest()
        self._mac = hmac.new(key, b"asyncrl sealed store: tag", "sha256").digest()
        self._timeout = timeout

    # ---- sealing -------------------------------------------------------------------------------
    def seal(self, key: str, value: bytes) -> bytes:
        """`value` as stored under `key`: nonce, ciphertext, tag."""
        nonce = secrets.token_bytes(_NONCE)
        body = nonce + _xor(value, self._stream(nonce, len(value)))
        return body + self._tag(key, body)

    def open(self, key: str, stored: bytes) -> bytes | None:
        """The value sealed under `key`, or None if `stored` was not sealed by this key for
        this name (forged, garbled, moved from another key)."""
        if not _NONCE + _TAG <= len(stored) <= MAX_VALUE + _NONCE + _TAG:
            return None
        body, tag = stored[:-_TAG], stored[-_TAG:]
        if not hmac.compare_digest(tag, self._tag(key, body)):
            return None
        nonce, ciphertext = body[:_NONCE], body[_NONCE:]
        return _xor(ciphertext, self._stream(nonce, len(ciphertext)))

    def _tag(self, key: str, body: bytes) -> bytes:
        name = f"{self._prefix}/{key}".encode()
        h = hmac.new(self._mac, _DOMAIN, hashlib.sha256)
        h.update(len(name).to_bytes(8, "little") + name + body)
        return h.digest()

    def _stream(self, nonce: bytes, size: int) -> bytes:
        blocks = (size + 31) // 32
        return b"".join(
            hmac.new(self._enc, nonce + i.to_bytes(8, "little"), hashlib.sha256).digest()
            for i in range(blocks)
        )[:size]

    def _opened(self, key: str) -> bytes | None:
        if not self._inner.check([key]):
            return None
        return self.open(key, bytes(self._inner.get(key)))

    # ---- the Store interface (what gloo's and NCCL's rendezvous and the join use) ------------
    def set(self, key: str, value: bytes | str) -> None:
        raw = value.encode() if isinstance(value, str) else bytes(value)
        self._inner.set(key, self.seal(key, raw))  # type: ignore[arg-type]  # bytes work

    def get(self, key: str) -> bytes:
        """The opened value of `key`, waiting (up to the timeout) for one that opens."""
        return self._wait_opened([key], self._timeout)[0]

    def get_within(self, key: str, timeout_s: float) -> bytes:
        """`get`, waiting at most `timeout_s` (TimeoutError after)."""
        return self._wait_opened([key], datetime.timedelta(seconds=timeout_s))[0]

    def check(self, keys: list[str]) -> bool:
        """Whether every key holds a value that opens (a forged one does not count)."""
        return all(self._opened(key) is not None for key in keys)

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        """Block until every key holds a value that opens; raises after the timeout, naming
        the keys still missing or holding values that do not open."""
        self._wait_opened(keys, timeout or self._timeout)

    def _wait_opened(self, keys: list[str], timeout: datetime.timedelta) -> list[bytes]:
        """The opened values of `keys`, each taken as it opened (an overwrite after it does
        not matter), waiting up to `timeout` for the last."""
        deadline = time.monotonic() + timeout.total_seconds()
        opened: dict[str, bytes] = {}
        while True:
            for key in keys:
                if key not in opened and (value := self._opened(key)) is not None:
                    opened[key] = value
            if len(opened) == len(keys):
                return [opened[key] for key in keys]
            if time.monotonic() >= deadline:
                missing = [k for k in keys if k not in opened]
                raise TimeoutError(
                    f"store keys {missing} under {self._prefix!r} hold no value sealed with "
                    f"this member's sync key after {timeout.total_seconds():g} s (absent, or "
                    "forged)"
                )
            time.sleep(POLL_S)

    def add(self, key: str, value: int) -> int:
        return self._inner.add(key, value)

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        raise RuntimeError(f"a sealed store cannot compare-and-set ({key!r})")

    def delete_key(self, key: str) -> bool:
        return self._inner.delete_key(key)

    def num_keys(self) -> int:
        return self._inner.num_keys()

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self._timeout = timeout


def _xor(data: bytes, stream: bytes) -> bytes:
    return (int.from_bytes(data, "little") ^ int.from_bytes(stream, "little")).to_bytes(
        len(data), "little"
    )
