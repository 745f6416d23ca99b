"""The lease desk: which prompts a rollout server gets when it asks.

A grant is evaluation prompts first (outside admission: they are never trained), then training
prompts within `AdmissionController` (staleness, capacity and the server's fair share of the
window while other servers ask, see `replay.admission`), never more than the server's own quota
(`rollout.max_concurrent_groups` less the training groups it holds). Training prompts come from
expired leases, those of dead servers and those a server could not sample (`fail`) first
(re-issued under fresh group ids), then from the `PromptSource`.

The desk also takes and restores the replay's state for a checkpoint (`data_state` / `restore`,
the format in `replay.checkpoint`), and measures how a batch's groups spread over the servers
(`lease_spread`, part of each batch's fleet metrics).

Wiring: `replay.components.setup_replay_components` builds one desk over its `LeaseRules` (what
it reads of the config), the replay's admission controller (shared with the batch desk and the
group filter, which free its slots), the prompt source, buffer, evaluation jobs and counters; the
service grants through it, and its held lease requests (`replay.held.HeldLeases`) tell it how
many servers are asking with every grant.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from asyncrl.config import Config
from asyncrl.data.rows import row_of_group, row_to_prompt_item
from asyncrl.wire.protocol import LeaseRequest, PromptItem
from replay.admission import AdmissionController
from replay.buffer import GroupBuffer
from replay.checkpoint import ReplayState
from replay.eval_jobs import EvalJobs
from replay.prompts import PromptSource, reissue

log = logging.getLogger("asyncrl.replay")


@dataclass(frozen=True)
class LeaseRules:
    """What the lease desk reads of the config."""

    samples_per_prompt: int  # rollout.n: the samples of one group
    max_concurrent_groups: int  # rollout.max_concurrent_groups: one server's quota
    num_servers: int  # rollout.num_servers: a failed row waits for another server when > 1
    lease_timeout_s: float  # replay.lease_timeout_s: an incomplete lease older is re-issued
    max_group_failures: int  # replay.max_group_failures: a row failing as often is given up

    @classmethod
    def from_config(cls, cfg: Config) -> LeaseRules:
        return cls(
            samples_per_prompt=cfg.rollout.n,
            max_concurrent_groups=cfg.rollout.max_concurrent_groups,
            num_servers=cfg.rollout.num_servers,
            lease_timeout_s=cfg.replay.lease_timeout_s,
            max_group_failures=cfg.replay.max_group_failures,
        )


class LeaseDesk:
    """Grants, expiry and the prompt stream's position (see the module docstring)."""

    def __init__(
        self,
        rules: LeaseRules,
        admission: AdmissionController,
        prompts: PromptSource,
        buffer: GroupBuffer,
        eval_jobs: EvalJobs,
        counters: Counter[str],
        failed_log: Path | None = None,
    ) -> None:
        """`admission`: the replay's, told of every grant and of every leased group that will
        never be trained; `failed_log`: the JSON-lines file given-up groups are written to
        (None: the log only)."""
        self.rules = rules
        self.admission = admission
        self.failed_log = failed_log
        self.prompts = prompts
        self.buffer = buffer
        self.eval_jobs = eval_jobs
        self.counters = counters
        self._rows_drawn = 0
        self._retry: deque[PromptItem] = deque()  # expired leases, granted again before new rows
        self._failed_on: dict[str, int] = {}  # row of a failed lease in _retry -> its server

    def wanted(self, req: LeaseRequest) -> int:
        """Groups `req`'s server may take now: what it asks for, within its quota
        (rollout.max_concurrent_groups less the training groups it holds already, so no peer
        can take the whole capacity)."""
        quota = self.rules.max_concurrent_groups - self.buffer.in_flight_of(req.server_id)
        return min(req.max_groups, max(0, quota))

    def grant(self, req: LeaseRequest, asking: int = 1) -> list[PromptItem]:
        """Evaluation prompts first (at most half the grant when training prompts could fill
        the rest), then training prompts; `asking`: servers that want work now, this one
        included (admission's fair share)."""
        wanted = self.wanted(req)
        # evaluation may take at most half the slots while training prompts can be granted, so
        # no evaluator starves training
        training = self._grantable(req, wanted, asking)
        evals = self.eval_jobs.take(max(wanted - training, math.ceil(wanted / 2)), req.server_id)
        self.counters["eval_leases_granted"] += len(evals)
        return evals + self._grant_training(req, wanted - len(evals), asking)

    def _grantable(self, req: LeaseRequest, wanted: int, asking: int) -> int:
        in_flight = self.buffer.in_flight_of(req.server_id)
        return self.admission.grantable(
            req.server_version, wanted, len(self.buffer), in_flight, asking
        )

    def _grant_training(self, req: LeaseRequest, wanted: int, asking: int) -> list[PromptItem]:
        if wanted <= 0:
            return []
        version = req.server_version
        k = self._grantable(req, wanted, asking)
        now = time.monotonic()
        prompts = [self._next_prompt(req.server_id) for _ in range(k)]
        for item in prompts:
            self.buffer.open_group(item, now, lease_version=version, server_id=req.server_id)
        self.admission.on_issued(k)
        self.counters["leases_granted"] += k
        return prompts

    def _next_prompt(self, server_id: int) -> PromptItem:
        """A lease to re-issue first, then a new row. A row a server could not sample goes to
        another server when the fleet has more than one (an error of that server's, such as its
        device's memory, does not use up the row's failures); it waits for one meanwhile."""
        alone = self.rules.num_servers == 1
        for i, item in enumerate(self._retry):
            if alone or self._failed_on.get(row_of_group(item.group_id)) != server_id:
                del self._retry[i]
                self._failed_on.pop(row_of_group(item.group_id), None)
                self.counters["leases_reissued"] += 1
                return reissue(item)
        row_index = self._rows_drawn
        self._rows_drawn += 1
        return row_to_prompt_item(self.prompts.next_row(), row_index, self.rules.samples_per_prompt)

    def expire(self, now: float) -> int:
        """Drop the leases older than `replay.lease_timeout_s`, to be re-issued first; returns
        how many expired."""
        timeout = self.rules.lease_timeout_s
        expired = self.buffer.expire(now, timeout)
        if expired:
            self.counters["expired"] += len(expired)
            self.admission.on_never_trained(len(expired))
            self._retry.extend(expired)
            log.warning("%d lease(s) expired after %.0fs; re-issuing", len(expired), timeout)
        return len(expired)

    def reissue_server(self, server_id: int, why: str) -> int:
        """Take back the incomplete leases of `server_id` (declared dead or replaced by a newer
        epoch, `replay.health`), to be re-issued first, as expired leases are; returns how
        many."""
        dropped = self.buffer.drop_server(server_id)
        self.counters["dead_server_leases"] += len(dropped)
        self.admission.on_never_trained(len(dropped))
        self._retry.extend(dropped)
        if dropped:
            log.warning("%s: re-issuing its %d incomplete lease(s)", why, len(dropped))
        else:
            log.info("%s (it held no incomplete lease)", why)
        return len(dropped)

    def fail(self, server_id: int, group_id: str, error: str) -> str:
        """`server_id` could not sample the group `group_id` leased to it (`GroupFailed`): the
        lease ends now. The row is leased again (a training row under a fresh group id, to
        another server when the fleet has more than one: `_next_prompt`) until it has failed
        `replay.max_group_failures` times; then it is given up: logged, counted
        (`rows_given_up`, `eval_groups_given_up`) and written to `failed_groups.jsonl` in the
        run directory with the start of its prompt. A given-up training row is never trained;
        an evaluation group is listed in its job's results. Returns "retried", "given_up", or
        "late" when no such group is leased to that server now (complete, expired or taken
        back: nothing changes)."""
        limit = self.rules.max_group_failures
        if self.eval_jobs.owns(group_id):
            item = self.eval_jobs.fail(group_id, server_id, limit)
        elif (item := self.buffer.drop_group(group_id, server_id)) is not None:
            self.admission.on_never_trained(1)
            if item.failures + 1 < limit:
                self._retry.append(dataclasses.replace(item, failures=item.failures + 1))
                self._failed_on[row_of_group(item.group_id)] = server_id
        if item is None:
            return "late"
        self.counters["groups_failed"] += 1
        if item.failures + 1 < limit:
            log.warning("server_%d could not sample group %s: %s", server_id, group_id, error)
            return "retried"
        self.counters["eval_groups_given_up" if item.eval_job else "rows_given_up"] += 1
        log.error("group %s given up after %d failures: %s", group_id, item.failures + 1, error)
        if self.failed_log is not None:
            self._write_failed(
                {
                    "group_id": group_id,
                    "eval_job": item.eval_job,
                    "data_source": item.data_source,
                    "prompt": item.messages[-1].content[:200] if item.messages else "",
                    "failures": item.failures + 1,
                    "server_id": server_id,
                    "error": error,
                    "time": time.time(),
                }
            )
        return "given_up"

    def _write_failed(self, record: dict) -> None:
        assert self.failed_log is not None
        try:
            with self.failed_log.open("a") as f:
                f.write(json.dumps(record) + "\n")
        except OSError as e:  # the log line above says it all the same
            log.error("cannot write %s: %s", self.failed_log, e)

    def data_state(self, version: int) -> ReplayState:
        """The replay's whole state at learner version `version`, for a checkpoint: the ready
        groups with their samples, the prompts leased but not complete (in flight or expired:
        leased again first on resume), the prompt stream's position, the remembered trajectory
        ids and the counters (`replay.checkpoint`)."""
        ready, incomplete, seen_ids = self.buffer.saved()
        return ReplayState(
            version=version,
            rows_drawn=self._rows_drawn,
            prompt_source=self.prompts.state(),
            reissue=[*incomplete, *self._retry],
            ready=ready,
            seen_ids=seen_ids,
            counters={k: int(v) for k, v in self.counters.items()},
        )

    def restore(self, state: ReplayState) -> int:
        """Resume from `data_state` (into a fresh desk and buffer): the ready groups go back in
        the buffer, the incomplete ones are leased again first, as fresh leases; admission
        counts the `version` x B groups trained before plus the ready ones as issued. Returns
        the version."""
        self.buffer.restore(state.ready, state.seen_ids)
        self.prompts.load_state(state.prompt_source)
        self._rows_drawn = state.rows_drawn
        self._retry.extend(state.reissue)
        for name, value in state.counters.items():  # they go on from where they stopped
            self.counters[name] = value
        self.admission.on_resumed(state.version, len(state.ready))
        log.info(
            "resumed at version %d: %d rows drawn, %d groups ready, %d prompts to lease again",
            state.version,
            self._rows_drawn,
            len(state.ready),
            len(self._retry),
        )
        return state.version


def lease_spread(server_ids: Iterable[int]) -> dict[str, float]:
    """How a batch's groups spread over the servers that generated them: how many servers
    (`batch_servers`) and the share of the busiest one (`batch_top_server_frac`; 1/M when M
    servers made equal parts, 1.0 when one server made the whole batch)."""
    counts = Counter(server_ids)
    if not counts:
        return {}
    top = max(counts.values())
    return {
        "batch_servers": float(len(counts)),
        "batch_top_server_frac": top / sum(counts.values()),
    }
