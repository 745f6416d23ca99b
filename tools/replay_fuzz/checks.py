"""What a campaign checks at the end: every message accounted for, and real work still works.

`check_accounting` is the invariant `received == handled + sum(rejected_*) + handler_errors`.
The replay of today reports neither `handled` nor `handler_errors`; until it does, `handled` is
the sum of the counters that count one handled message each, plus the answers that no counter
counts (a `Stats`, an `EvalResults`, an `Ack(ok)`: version updates, evaluation jobs and
checkpoints). `round_trip` does what a rollout server and the learner do: lease, send samples,
take a batch.
"""

from __future__ import annotations

import numpy as np

from asyncrl import protocol as P

HANDLED_BY_TYPE = (
    "lease_requests",
    "accepted",
    "duplicates",
    "late",
    "eval_samples",
    "batch_requests",
)
"""Counters that count one handled message each, on a replay without a `handled` counter."""
UNCOUNTED_ANSWERS = ("stats", "eval_results", "ack_ok")
"""Answers to handled messages that no counter of such a replay counts."""


def check_accounting(
    counters: dict[str, float], sent: int, replies: dict[str, int], crashed: int = 0
) -> list[str]:
    """What does not add up (empty: every message is accounted for). `sent`: messages sent to
    this replay process (the StatsRequest that read `counters` included); `replies`: the
    answers received, by `clients.reply_name`; `crashed`: messages whose handling raised, as
    the fuzzer saw (they count as handler errors on a replay without that counter)."""
    c = {k: int(v) for k, v in counters.items()}
    rejected = sum(v for k, v in c.items() if k.startswith("rejected_"))
    errors = c.get("handler_errors", crashed)
    if "handled" in c:
        # the StatsRequest that read the counters may not be counted yet: in `received` (a
        # replay that counts a message once done with it), or in `handled`
        handled = c["handled"]
        slack, counted = (0, 1), (sent - 1, sent)
    else:
        handled = sum(c[k] for k in HANDLED_BY_TYPE) + sum(
            replies.get(k, 0) for k in UNCOUNTED_ANSWERS
        )
        slack, counted = (0,), (sent,)
    problems = []
    if c["received"] not in counted:
        problems.append(f"received {c['received']} != {sent} messages sent")
    if c["received"] - (handled + rejected + errors) not in slack:
        problems.append(
            f"received {c['received']} != handled {handled} + rejected {rejected} "
            f"+ handler errors {errors}"
        )
    if errors:
        problems.append(f"{errors} handler errors (crashes)")
    return problems


def round_trip(ask, batch_groups: int, capacity_groups: int, server_id: int) -> str:
    """Lease training groups, complete them, and get every one back in a batch; "ok" or what
    went wrong. `ask(msg) -> answer | None` sends one message and waits for its answer;
    `server_id`: a server id the fuzzing did not use.

    The learner version is set first to one at which admission lets a server lease a full
    buffer, whatever the fuzzing did to it. Evaluation prompts left by the fuzzing are leased
    first (they are not ours), then exactly enough training groups to fill whole batches, each
    completed as soon as it is granted (an incomplete lease could expire while we wait for room),
    so that ours are the newest groups and all of them leave in batches."""
    stats = ask(P.StatsRequest(request_id=1))
    if not isinstance(stats, P.Stats):
        return f"no Stats answer ({stats!r:.200})"
    version = int(stats.counters["groups_issued"]) // batch_groups + capacity_groups + 2
    if not isinstance(ask(P.VersionUpdate(request_id=2, version=version)), P.Ack):
        return "no Ack to the VersionUpdate"
    ours = _lease_and_complete(ask, version, batch_groups, server_id)
    if isinstance(ours, str):
        return ours
    wanted = set(ours)
    for k in range(capacity_groups // batch_groups + 10):
        batch = ask(P.BatchRequest(1000 + k, learner_version=version, num_groups=batch_groups))
        if not isinstance(batch, P.Batch):
            return f"batch request {k}: answered {batch!r:.200}"
        wanted -= set(batch.group_ids)
        if not wanted:
            return "ok"
    return f"{len(wanted)} of our {len(ours)} groups never came back in a batch"


def _lease_and_complete(ask, version: int, batch_groups: int, server: int) -> list[str] | str:
    """Complete training groups, a multiple of `batch_groups` of them; their ids (or what went
    wrong)."""
    ours: list[str] = []
    evaluation_left = True
    for k in range(300):
        if evaluation_left:  # every evaluation prompt left pending, in big grants
            need = 4096
        elif ours and len(ours) % batch_groups == 0:
            return ours
        else:  # then exactly enough to fill whole batches
            need = batch_groups - len(ours) % batch_groups
        grant = ask(
            P.LeaseRequest(10 + k, server_id=server, server_version=version, max_groups=need)
        )
        if not isinstance(grant, P.LeaseGrant):
            return f"lease request {k}: answered {grant!r:.200}"
        evaluation_left = evaluation_left and any(p.eval_job for p in grant.prompts)
        for p in grant.prompts:
            if p.eval_job:
                continue  # an evaluation prompt: not ours
            for i in range(p.n):
                ack = ask(_sample(p.group_id, i, version, server))
                if not (isinstance(ack, P.Ack) and ack.status == "accepted"):
                    return f"sample {i} of {p.group_id}: answered {ack!r:.200}"
            ours.append(p.group_id)
    return f"{len(ours)} training groups, not whole batches of {batch_groups}, after 300 leases"


def _sample(group_id: str, index: int, version: int, server: int) -> P.Trajectory:
    r = 4
    return P.Trajectory(
        traj_id=f"round-trip/{group_id}/{index}",
        attempt=0,
        group_id=group_id,
        sample_index=index,
        server_id=server,
        prompt_ids=np.arange(3, dtype=np.int32),
        response_ids=np.arange(r, dtype=np.int32),
        loss_mask=np.ones(r, np.uint8),
        behaviour_logprobs=np.full(r, -0.5, np.float32),
        versions=np.full(r, version, np.int32),
        reward=1.0,
        baseline_reward=float("nan"),
        finish_reason="stop",
        metrics={},
    )
