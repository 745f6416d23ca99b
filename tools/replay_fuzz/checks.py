"""What a campaign checks at the end: every message accounted for, and real work still works.

`check_accounting` is the replay's invariant `received == handled + sum(rejected_*) +
handler_errors` (`asyncrl.wire.router`, `asyncrl.wire.router.OUTCOMES`), with no handler error, and every message sent received.
`round_trip` does what a rollout server and the learner do: lease, send samples, take a batch.
"""

from __future__ import annotations

import numpy as np

from asyncrl.wire import protocol as P
from asyncrl.wire import samples as S
from asyncrl.wire.router import OUTCOMES, accounted


def check_accounting(counters: dict[str, float], sent: int) -> list[str]:
    """What does not add up (empty: every message is accounted for). `sent`: messages sent to
    this replay process, the StatsRequest that read `counters` included (the replay counts a
    message once done with it, so that one is not in `counters` yet)."""
    c = {k: int(v) for k, v in counters.items()}
    problems = []
    if c["received"] != sent - 1:
        problems.append(f"received {c['received']} != {sent - 1} messages sent before the stats")
    if not accounted(counters):
        parts = ", ".join(f"{k} {c[k]}" for k in OUTCOMES if c[k])
        problems.append(f"received {c['received']} != the sum of its outcomes ({parts})")
    if c["handler_errors"]:
        problems.append(f"{c['handler_errors']} handler errors (crashes)")
    return problems


def round_trip(ask, batch_groups: int, capacity_groups: int, server_id: int) -> str:
    """Lease training groups, complete them, and get every one back in a batch; "ok" or what
    went wrong. `ask(msg) -> answer | None` sends one message and waits for its answer;
    `server_id`: a server id the fuzzing did not use.

    The learner version is set first to one at which admission lets a server lease a full
    buffer, whatever the fuzzing did to it. Leases come in grants of 64 while evaluation prompts
    the fuzzing left are pending (they are leased first, and are not ours), then of exactly what
    fills a batch. Each group is completed as soon as it is granted (an incomplete lease could
    expire while we wait), and batches are taken whenever ours could fill one (the buffer holds
    ready groups until a batch takes them: waiting for more leases could wait for ever)."""
    stats = ask(P.StatsRequest(request_id=1))
    if not isinstance(stats, P.Stats):
        return f"no Stats answer ({stats!r:.200})"
    version = int(stats.counters["groups_issued"]) // batch_groups + capacity_groups + 2
    if not isinstance(ask(P.VersionUpdate(request_id=2, version=version)), P.Ack):
        return "no Ack to the VersionUpdate"
    pending: set[str] = set()  # our complete groups, not back yet
    served, evaluation_left = 0, True
    for k in range(500):
        if served and not pending:
            return "ok"
        if len(pending) >= batch_groups:
            batch = ask(S.BatchRequest(1000 + k, learner_version=version, num_groups=batch_groups))
            if not isinstance(batch, S.Batch):
                return f"batch request {k}: answered {batch!r:.200}"
            served += len(pending & set(batch.group_ids))
            pending -= set(batch.group_ids)
            continue
        need = 64 if evaluation_left else batch_groups - len(pending)
        grant = ask(P.LeaseRequest(10 + k, server_id, server_version=version, max_groups=need))
        if not isinstance(grant, P.LeaseGrant):
            return f"lease request {k}: answered {grant!r:.200}"
        evaluation_left = any(p.eval_job for p in grant.prompts)
        for p in grant.prompts:
            if p.eval_job:
                continue  # an evaluation prompt: not ours
            for i in range(p.n):
                ack = ask(_sample(p.group_id, i, version, server_id))
                if not (isinstance(ack, P.Ack) and ack.status == "accepted"):
                    return f"sample {i} of {p.group_id}: answered {ack!r:.200}"
            pending.add(p.group_id)
    return f"{served} groups back in batches, {len(pending)} not, after 500 requests"


def _sample(group_id: str, index: int, version: int, server: int) -> S.Trajectory:
    r = 4
    return S.Trajectory(
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
