"""The reward-model server: one process, one ZeroMQ ROUTER, one single-threaded poll loop that
scores what the rollout servers (and clients) send it with one `Scorer`.

One tick (`poll_once`): wait for a message; take every message waiting (no more blocking), so
the requests that arrived together are scored together; score their items in batches of
`reward.model.max_batch` (items of different requests share a batch); reply `Scores` to each
request, in its items' order, signed with the key of the role that asked.

Every message goes through `asyncrl.wire.router.RouterService` and ends in exactly one of its
outcome counters (`OUTCOMES`): a `ScoreRequest` from a `server_<i>` (any epoch) or the `client` is
`handled`; anything else is rejected and counted, and nothing a peer sends stops the loop
(`reward_models.access` says who may ask). A message over `MAX_MESSAGE_BYTES` is rejected
oversized before its signature is checked. A scorer that raises on a whole batch (a bug, the
device out of memory) is logged and counted (`batch_failures`); each request of that tick is
answered `Error`, and the loop goes on.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import Counter
from pathlib import Path

import torch

from asyncrl.config import Config
from asyncrl.metrics import peak_rss_mb
from asyncrl.placement import maybe_limit_gpu_memory
from asyncrl.run_spec import RunSpec
from asyncrl.wire.auth import secret_from_env
from asyncrl.wire.protocol import Error
from asyncrl.wire.reward_protocol import MAX_SCORE_ERROR_CHARS, ScoreItem, ScoreRequest, Scores
from asyncrl.wire.router import OUTCOMES, POLL_INTERVAL_S, Peer, RouterService
from asyncrl.wire.serve import serve_until_signal
from reward_models.access import RewardModelAccess
from reward_models.scorers import Scored, Scorer, resolve_device, setup_scorer

log = logging.getLogger("asyncrl.reward_models")

MAX_MESSAGE_BYTES = 64 * 2**20
"""The largest request a server or a client may send (all frames): 1024 items of 64 KB each."""
MAX_REFUSED_BYTES = 2**16
"""The limit of a role that may send nothing here (the learner): it is refused anyway."""
COUNTERS = (
    "received",
    *OUTCOMES,
    "requests",
    "items",
    "batches",
    "score_errors",
    "batch_failures",
)
"""Every counter the server reports, present (as 0) from the start; `stats` adds `busy_s`."""


class RewardModelServer(RouterService):
    """The poll loop over an authenticated ROUTER socket (see the module docstring)."""

    def __init__(
        self,
        scorer: Scorer,
        max_batch: int,
        address: str,
        secret: bytes,
        num_servers: int,
        allow_remote: bool = False,
        max_message_bytes: int = MAX_MESSAGE_BYTES,
    ) -> None:
        """Bind `address`; `num_servers`: the run's rollout servers (`rollout.num_servers`),
        each of which (any epoch) may ask, as may the client."""
        limits = {"server": max_message_bytes, "client": max_message_bytes}
        limits["learner"] = min(MAX_REFUSED_BYTES, max_message_bytes)
        access = RewardModelAccess(secret, num_servers)
        counters: Counter[str] = Counter(dict.fromkeys(COUNTERS, 0))
        name = "a reward-model server"
        super().__init__(address, access, limits, allow_remote, counters, name=name, logger=log)
        self.scorer, self.max_batch, self.address = scorer, max_batch, address
        self.busy_s = 0.0  # time spent scoring
        self._waiting: list[tuple[Peer, ScoreRequest]] = []
        self._handlers = {ScoreRequest: self._on_score_request}
        log.info("reward-model server listening on %s (batches of %d)", address, max_batch)

    def run(self, stop: threading.Event | None = None) -> dict[str, float]:
        """Serve until `stop` is set; returns the final counters."""
        while stop is None or not stop.is_set():
            self.poll_once(POLL_INTERVAL_S)
        return self.stats()

    def poll_once(self, timeout_s: float) -> None:
        """One tick: wait up to `timeout_s` for a message, take all those waiting, score their
        requests together and answer each."""
        if self._receive(timeout_s):
            self.score_waiting()

    def stats(self) -> dict[str, float]:
        """Counters and gauges."""
        counters = {k: float(v) for k, v in self.counters.items()}
        return {**counters, "busy_s": self.busy_s, "peak_rss_mb": peak_rss_mb()}

    def _on_score_request(self, peer: Peer, req: ScoreRequest) -> None:
        """Held until the messages waiting with it are taken (`score_waiting` answers it)."""
        self.counters["requests"] += 1
        self.counters["items"] += len(req.items)
        self._waiting.append((peer, req))

    def score_waiting(self) -> None:
        """Score every held request's items together, in batches of `max_batch`, and reply
        to each request with its own slice, in order."""
        waiting, self._waiting = self._waiting, []
        if not waiting:
            return
        items = [item for _, req in waiting for item in req.items]
        start = time.monotonic()
        try:
            scored = self._score(items)
        except Exception as e:  # the whole batch failed: counted, logged, answered; go on
            self.counters["batch_failures"] += 1
            if self.counters["batch_failures"] <= 10:
                log.exception("scoring %d items raised", len(items))
            reason = f"the reward model failed on this batch: {type(e).__name__}: {e}"[:500]
            for peer, _ in waiting:
                self._send(peer, Error(reason=reason))
            return
        finally:
            self.busy_s += time.monotonic() - start
        offset = 0
        for peer, req in waiting:
            mine = scored[offset : offset + len(req.items)]
            offset += len(req.items)
            scores = [score for score, _ in mine]
            errors = [error for _, error in mine]
            self._send(peer, Scores(request_id=req.request_id, scores=scores, errors=errors))

    def _score(self, items: list[ScoreItem]) -> list[Scored]:
        """The scorer's (score, error) per item, batch by batch; one that is not finite, or an
        error too long for a reply, is made fit to send (a scorer is trusted, not assumed)."""
        out: list[Scored] = []
        for start in range(0, len(items), self.max_batch):
            chunk = items[start : start + self.max_batch]
            scored = self.scorer.score(chunk)
            if len(scored) != len(chunk):
                raise RuntimeError(f"the scorer gave {len(scored)} scores for {len(chunk)} items")
            self.counters["batches"] += 1
            out.extend(_fit(score, error) for score, error in scored)
        self.counters["score_errors"] += sum(1 for _, error in out if error)
        return out


def _fit(score: float, error: str) -> Scored:
    if error:
        return 0.0, error[:MAX_SCORE_ERROR_CHARS]
    if not math.isfinite(score):
        return 0.0, f"a score of {score}"
    return float(score), ""


def summarize(counters: dict[str, float]) -> str:
    """One line for logs: what was asked, scored, failed and refused."""
    c = {k: int(v) for k, v in counters.items()}
    rejected = sum(v for k, v in c.items() if k.startswith("rejected_"))
    return (
        f"{c['requests']} requests, {c['items']} items in {c['batches']} batches "
        f"({c['score_errors']} items unscored, {c['batch_failures']} batches failed); "
        f"{rejected} messages rejected, {c['handler_errors']} handler errors; "
        f"busy {counters['busy_s']:.1f} s"
    )


def run_reward_model_server(spec: RunSpec, cfg: Config, index: int) -> None:
    """Entry point of reward-model server `index`: load the model (`reward.model`), serve
    `spec.reward_model_addresses[index]` until SIGTERM/SIGINT, then write the final counters
    to `run_dir/stats/reward_model_<index>.json` (atomically) and log a one-line summary. The
    run secret comes from the environment (`asyncrl.wire.auth`). On a GPU it holds to its placed
    share of the GPU's memory (`asyncrl.placement`, rule 5), set before the model loads, and
    states it in its log."""
    torch.set_num_threads(spec.threads)
    place = spec.own_place(f"reward_model_{index}")
    device = resolve_device(cfg.reward.model.device)
    if device == "cuda":
        maybe_limit_gpu_memory(place, torch.device("cuda", 0))
    scorer = setup_scorer(cfg.reward.model, device)
    server = RewardModelServer(
        scorer,
        cfg.reward.model.max_batch,
        spec.reward_model_addresses[index],
        secret_from_env(),
        cfg.rollout.num_servers,
        cfg.launch.allow_remote,
    )
    stats_path = Path(spec.run_dir) / "stats" / f"reward_model_{index}.json"
    serve_until_signal(server, stats_path, summarize, f"reward-model server {index}", log)
