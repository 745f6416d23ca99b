"""The replay service: one process, one ZeroMQ ROUTER, one single-threaded poll loop.

Components (`replay.components`, built by `setup_replay_components`; `setup_replay_service`
hands them to a `ReplayService`, whose loop drives them):
- access rules (`replay.access`): who signed a message, whether its role may send it, where a
  checkpoint may be written. The service is an `asyncrl.wire.router.RouterService`, which applies
  them.
- lease desk (`replay.leases`): grants leases, prompts from a `PromptSource` (`replay.prompts`),
  as many as the replay's `AdmissionController` allows (`replay.admission`), evaluation prompts
  first.
- buffer (`replay.buffer`): holds each lease's samples until the learner takes its group.
- sample intake (`replay.intake`): where each arriving sample goes (its group or evaluation job)
  and its Ack status; an untrainable sample (`replay.sample_checks`) is rejected alone.
- group filter (`replay.group_filter`): with `replay.filter_groups` on, a group whose samples
  all score alike is dropped as it completes, its slot freed (DAPO's dynamic sampling).
- batch desk (`replay.batches`): batches out of the buffer, too-stale groups dropped first.
- evaluation jobs (`replay.eval_jobs`): evaluation prompts and their scores.
- health (`replay.health`): which server epochs are alive; a dead epoch's leases are re-issued.
- fleet stats (`replay.fleet_stats`): the servers' counters, told to the learner per batch.
- held requests (`replay.held`, built by the service over its socket): a lease or batch request
  is answered at once when it can be; otherwise held, one queue per kind, and answered as soon
  as something changes (a group completes, the learner moves on or consumes, a group is
  dropped: `replay.held.Changes` sees one of the counters of those events move), or answered
  empty after `replay.wait_timeout_s` so clients simply ask again.

One tick (`poll_once`): handle the messages that arrived, expire leases and silent servers,
answer the held requests if something changed, then those whose wait is over.

Messages (see `asyncrl.wire.protocol`):
- LeaseRequest -> LeaseGrant: admission judges a server by the version its engine holds (the
  request says); a server asks again as soon as its engine moves to a new version, and that
  newer request supersedes its held one. The servers asking (the requester and every server
  with a request held and free slots) split the staleness window (`replay.admission`).
- Trajectory -> Ack(accepted | duplicate | late | rejected), Trajectories -> Acks (one status
  per sample): every trajectory is acknowledged every time it arrives, so a resending sender
  stops; `rejected` (it decoded but cannot be trained on: uneven arrays, NaN reward, ...) is
  also logged and counted (`untrainable`).
- BatchRequest -> Batch: exactly `num_groups` whole groups trainable at the request's
  `learner_version` (authoritative), or an empty batch after the wait.
- Heartbeat -> Ack(ok | rejected): `replay.health`; a server silent for
  `launch.server_timeout_s` (no heartbeat, lease request or sample: each is a sign of life) is
  declared dead and the incomplete leases of a dead or replaced epoch are re-issued at once.
- DeclareDead -> Ack(ok): learner rank 0 gave up on that server epoch in a weight sync; if it is
  the epoch alive, it is declared dead as if silent (an older or already dead one: no effect).
- GroupFailed -> Ack(ok | late): the server could not sample that group; its lease ends now and
  the row is leased again or given up (`replay.leases.LeaseDesk.fail`).
- VersionUpdate -> Ack(ok); StatsRequest -> Stats (with every server's health); EvalSubmit ->
  Ack; EvalPoll -> EvalResults; CheckpointRequest -> Ack: the replay's whole state at the
  request's version, which must be the learner version it last heard, written to the file asked
  for, which must lie inside the run directory (`replay.checkpoint`).
Every message is authenticated first and its role must be allowed to send it; each ends in
exactly one outcome counter, and nothing a peer sends stops the loop (`asyncrl.wire.router`).
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Literal

from asyncrl.checkpoints import REPLAY_FILE
from asyncrl.config import Config
from asyncrl.metrics import peak_rss_mb
from asyncrl.wire.auth import secret_from_env
from asyncrl.wire.protocol import (
    Ack,
    CheckpointRequest,
    DeclareDead,
    EvalPoll,
    EvalSubmit,
    GroupFailed,
    Heartbeat,
    LeaseRequest,
    Stats,
    StatsRequest,
    VersionUpdate,
)
from asyncrl.wire.router import POLL_INTERVAL_S, Peer, RouterService
from asyncrl.wire.samples import Acks, BatchRequest, Trajectories, Trajectory
from asyncrl.wire.serve import serve_until_signal
from asyncrl.wire.validation import short_repr
from replay.access import AccessRules
from replay.checkpoint import ReplayState, read_state, write_state
from replay.components import ReplayComponents, setup_replay_components
from replay.counters import summarize
from replay.eval_jobs import EvalForbidden, EvalQuotaExceeded
from replay.held import Changes, HeldBatches, HeldLeases
from replay.prompts import PromptSource

log = logging.getLogger("asyncrl.replay")


class ReplayService(RouterService):
    """The replay's main loop over an authenticated ROUTER socket (see the module docstring)."""

    access: AccessRules  # the router's rules, with where checkpoints may be written

    def __init__(self, cfg: Config, address: str, parts: ReplayComponents) -> None:
        """Bind `address` and drive `parts` (`setup_replay_components`)."""
        rc = cfg.replay
        max_bytes = int(rc.max_message_mb * 2**20)
        limits = {"learner": max_bytes, "server": max_bytes}
        limits["client"] = int(rc.max_client_message_mb * 2**20)
        super().__init__(
            address, parts.access, limits, cfg.launch.allow_remote, parts.counters, logger=log
        )
        self.cfg = cfg
        self.address = address
        self.buffer = parts.buffer
        self.eval_jobs = parts.eval_jobs
        self.admission = parts.admission
        self.leases = parts.leases
        self.batches = parts.batches
        self.intake = parts.intake
        self.health = parts.health
        self.fleet = parts.fleet
        self.learner_version = 0
        self.held_leases = HeldLeases(self._send, self.counters, rc.wait_timeout_s)
        self.held_batches = HeldBatches(self._send, self.counters, rc.wait_timeout_s)
        self._changes = Changes(self.counters)
        self._next_expire_at = 0.0
        self._handlers = {
            LeaseRequest: self._on_lease_request,
            Trajectory: self._on_trajectory,
            Trajectories: self._on_trajectories,
            Heartbeat: self._on_heartbeat,
            DeclareDead: self._on_declare_dead,
            GroupFailed: self._on_group_failed,
            BatchRequest: self._on_batch_request,
            VersionUpdate: self._on_version_update,
            StatsRequest: self._on_stats_request,
            EvalSubmit: self._on_eval_submit,
            EvalPoll: self._on_eval_poll,
            CheckpointRequest: self._on_checkpoint,
        }
        log.info(
            "replay listening on %s (max_staleness=%d, groups/batch=%d, capacity=%d groups)",
            address,
            rc.max_staleness,
            cfg.data.train_batch_size,
            rc.capacity_groups,
        )

    # ---- main loop ------------------------------------------------------------------------
    def run(self, stop: threading.Event | None = None) -> dict[str, float]:
        """Serve until `stop` is set; returns the final counters."""
        while stop is None or not stop.is_set():
            self.poll_once(self._poll_timeout())
        return self.stats()

    def poll_once(self, timeout_s: float) -> None:
        """One tick: wait up to `timeout_s` for messages, handle what arrived, then expire
        leases, answer held requests that can now be answered and those whose wait is over."""
        self._receive(timeout_s)
        now = time.monotonic()
        self._maybe_expire(now)
        if self._changes.since_last_look():  # batches first: consuming frees capacity
            self.held_batches.answer(self.batches)
            self.held_leases.answer(self.leases)
        self.held_batches.time_out(now)
        self.held_leases.time_out(now)

    def _poll_timeout(self) -> float:
        due = min(self.held_leases.earliest_deadline(), self.held_batches.earliest_deadline())
        return min(POLL_INTERVAL_S, max(0.0, due - time.monotonic()))

    def stats(self) -> dict[str, float]:
        """Counters and gauges (see `Stats`)."""
        return {
            **{k: float(v) for k, v in self.counters.items()},
            "groups_ready": float(self.buffer.num_ready),
            "groups_in_flight": float(self.buffer.num_in_flight),
            "groups_issued": float(self.admission.issued),
            "held_lease_requests": float(len(self.held_leases)),
            "held_batch_requests": float(len(self.held_batches)),
            "learner_version": float(self.learner_version),
            "eval_jobs_freed": float(self.eval_jobs.freed),
            "eval_jobs_held_mb": self.eval_jobs.held_bytes / 2**20,  # replay.eval_jobs_mb caps it
            "servers_forgotten": float(self.fleet.forgotten),
            "servers_alive": float(len(self.health.epochs())),
            "peak_rss_mb": peak_rss_mb(),
        }

    def restore(self, state: ReplayState) -> None:
        """Resume from `LeaseDesk.data_state`, before any lease is granted: ready groups are
        trained, not generated again; incomplete leases are leased again first."""
        self.learner_version = self.leases.restore(state)

    def close(self, linger_ms: int = 100) -> None:
        """Answer every held request empty (so no client waits for nothing) and close, giving
        those answers at most `linger_ms` to leave."""
        self.held_leases.close()
        self.held_batches.close()
        super().close(linger_ms)

    # ---- one message ------------------------------------------------------------------------
    def _on_lease_request(self, peer: Peer, req: LeaseRequest) -> None:
        now = time.monotonic()
        self.counters["lease_requests"] += 1
        self.health.touch(req.server_id, now)
        self.fleet.report(req.server_id, req.engine_busy_s, req.weight_apply_s, req.uptime_s, now)
        # a newer request from the same server carries its current version and free slots
        self.held_leases.supersede(req.server_id, peer.identity)
        self.held_leases.grant_or_hold(peer, req, self.leases, now)

    def _on_trajectory(self, peer: Peer, traj: Trajectory) -> None:
        self.health.touch(traj.server_id, time.monotonic())
        status, why = self.intake.take(traj)
        if why:  # an untrainable sample alone is its message's outcome too
            self._reject(peer, "rejected_invalid", why, reply=False)
        self._send(peer, Ack(request_id=0, traj_id=traj.traj_id, status=status))

    def _on_trajectories(self, peer: Peer, msg: Trajectories) -> None:
        """Each sample as if it came alone; the message itself is `handled`."""
        self.health.touch(msg.server_id, time.monotonic())
        taken = [self.intake.take(traj, alone=False) for traj in msg.unpack()]
        for why in [why for _, why in taken if why][:3]:
            log.warning("rejected sample: %s", why)
        self._send(peer, Acks(traj_ids=msg.traj_ids, statuses=[status for status, _ in taken]))

    def _on_batch_request(self, peer: Peer, req: BatchRequest) -> None:
        if req.num_groups > self.cfg.replay.capacity_groups:
            reason = (
                f"num_groups {req.num_groups} outside 1..{self.cfg.replay.capacity_groups} "
                "(replay.capacity_groups)"
            )
            self._reject(peer, "rejected_invalid", reason)
            return
        self.counters["batch_requests"] += 1
        self.held_batches.supersede(peer.identity)
        self.held_batches.serve_or_hold(peer, req, self.batches, time.monotonic())

    def _on_version_update(self, peer: Peer, msg: VersionUpdate) -> None:
        if msg.version < self.learner_version:
            log.warning(
                "learner version went back from %d to %d", self.learner_version, msg.version
            )
        self.learner_version = msg.version
        self.counters["version_updates"] += 1
        self._send(peer, Ack(request_id=msg.request_id, traj_id="", status="ok"))

    def _on_eval_submit(self, peer: Peer, msg: EvalSubmit) -> None:
        try:
            now = time.monotonic()
            owner = (peer.role, peer.identity)
            self.eval_jobs.submit(msg.job_id, msg.prompts, now, msg.more, self._size, owner)
        except EvalForbidden as e:
            self._reject(peer, "rejected_forbidden", str(e))
            return
        except EvalQuotaExceeded as e:
            self._reject(peer, "rejected_quota", str(e))
            return
        except ValueError as e:
            self._reject(peer, "rejected_invalid", str(e))
            return
        self.counters["eval_jobs"] += 1  # held lease requests can now be granted these prompts
        self._send(peer, Ack(request_id=msg.request_id, traj_id="", status="ok"))

    def _on_eval_poll(self, peer: Peer, msg: EvalPoll) -> None:
        try:
            owner = (peer.role, peer.identity)
            results = self.eval_jobs.results(msg.request_id, msg.job_id, time.monotonic(), owner)
        except EvalForbidden as e:
            self._reject(peer, "rejected_forbidden", str(e))
            return
        except KeyError:
            reason = f"unknown evaluation job {short_repr(msg.job_id)} (never submitted, or freed)"
            self._reject(peer, "rejected_invalid", reason)
            return
        self._send(peer, results)

    def _on_checkpoint(self, peer: Peer, msg: CheckpointRequest) -> None:
        try:
            path = self.access.checkpoint_path(msg.path)
        except ValueError as e:
            self._reject(peer, "rejected_forbidden", str(e))
            return
        if msg.version != self.learner_version:  # the state must be at the saved weights' version
            reason = (
                f"checkpoint at version {msg.version}, but the learner is at {self.learner_version}"
            )
            self._reject(peer, "rejected_invalid", reason)
            return
        try:
            write_state(path, self.leases.data_state(msg.version))
        except OSError as e:
            self._reject(peer, "rejected_invalid", f"cannot write checkpoint {path}: {e}")
            return
        self._send(peer, Ack(request_id=msg.request_id, traj_id="", status="ok"))

    def _on_stats_request(self, peer: Peer, msg: StatsRequest) -> None:
        servers = self.health.report(time.monotonic(), self.buffer.in_flight_of)
        self._send(peer, Stats(request_id=msg.request_id, counters=self.stats(), servers=servers))

    def _on_heartbeat(self, peer: Peer, msg: Heartbeat) -> None:
        verdict, why = self.health.observe(msg.server_id, msg.epoch, time.monotonic())
        if verdict == "refused":  # its sender stops on this answer
            self._reject(peer, "rejected_invalid", why, reply=False)
        elif verdict == "replaced":
            self._take_back(msg.server_id, why)
        status: Literal["rejected", "ok"] = "rejected" if verdict == "refused" else "ok"
        self._send(peer, Ack(request_id=msg.request_id, traj_id="", status=status))

    def _on_declare_dead(self, peer: Peer, msg: DeclareDead) -> None:
        if self.health.declare(msg.server_id, msg.epoch):
            why = f"server_{msg.server_id} epoch {msg.epoch} declared dead by the learner"
            log.warning("%s: %s", why, msg.reason)
            self._take_back(msg.server_id, why)
        self._send(peer, Ack(request_id=msg.request_id, traj_id="", status="ok"))

    def _on_group_failed(self, peer: Peer, msg: GroupFailed) -> None:
        self.health.touch(msg.server_id, time.monotonic())
        outcome = self.leases.fail(msg.server_id, msg.group_id, msg.error)
        self._send(peer, Ack(msg.request_id, "", "late" if outcome == "late" else "ok"))

    # ---- timers and dead servers ------------------------------------------------------------
    def _take_back(self, server_id: int, why: str) -> None:
        """A dead or replaced epoch: its incomplete leases are re-issued, and a lease request
        of it still held is answered empty."""
        self.leases.reissue_server(server_id, why)
        self.eval_jobs.reissue_server(server_id)  # validation prompts too
        self.fleet.forget(server_id)  # a new epoch's counters start from 0
        self.held_leases.supersede(server_id)

    def _maybe_expire(self, now: float) -> None:
        if now < self._next_expire_at:
            return
        timeout = self.cfg.replay.lease_timeout_s
        self._next_expire_at = now + min(1.0, timeout / 4)
        self.fleet.forget_silent(now, timeout)
        for server_id in self.health.declare_silent(now):
            silent = self.cfg.launch.server_timeout_s
            self._take_back(server_id, f"server_{server_id} declared dead (silent > {silent}s)")
        self.eval_jobs.expire(now)
        self.leases.expire(now)


def setup_replay_service(
    cfg: Config,
    address: str,
    run_dir: str | Path | None,
    model_path: str | None = None,
    secret: bytes | None = None,
    prompts: PromptSource | None = None,
) -> ReplayService:
    """A replay bound to `address`, its components built for `cfg` (`setup_replay_components`:
    `run_dir` for checkpoints, `model_path` for the token limits and the prompts' tokenizer,
    `prompts` to override the config's prompt source) and, when `trainer.resume_from` is set,
    resumed from that checkpoint. `secret`: the run secret (default: from the environment,
    `asyncrl.wire.auth`)."""
    secret = secret_from_env() if secret is None else secret
    parts = setup_replay_components(cfg, secret, run_dir, model_path, prompts)
    service = ReplayService(cfg, address, parts)
    if cfg.trainer.resume_from is not None:
        service.restore(read_state(Path(cfg.trainer.resume_from) / REPLAY_FILE))
    return service


def run_replay(cfg: Config, address: str, run_dir: str, model_path: str | None = None) -> None:
    """Entry point of the replay process: serve until SIGTERM/SIGINT, then write the final
    counters to `run_dir/stats/replay.json` (atomically) and log a one-line summary.
    `model_path` gives the tokenizer for `data.max_prompt_length`; the run secret comes from
    the environment (`asyncrl.wire.auth`)."""
    service = setup_replay_service(cfg, address, run_dir, model_path)
    stats_path = Path(run_dir) / "stats" / "replay.json"
    serve_until_signal(service, stats_path, summarize, "replay", log)
