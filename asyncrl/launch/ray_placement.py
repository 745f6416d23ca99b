"""Placement for the Ray launcher (`ray_cluster.py`): which fleet process reserves what, and the
placement groups that hold those reservations.

- `launch.allow_remote=false` (the default, loopback sockets): one STRICT_PACK placement group
  with a bundle per rollout server (`launch.ray.server_num_cpus/gpus`) and per learner rank
  (`launch.ray.learner_num_cpus/gpus`): the whole fleet on one node, every address
  `launch.host`.
- `launch.allow_remote=true`: the learner ranks in one placement group
  (`launch.ray.learner_strategy`), the servers in another (PACK), and every service bound to
  the IP address of its node as Ray reports it.
The replay needs no reserved resources: it runs with 0 CPUs next to the first bundle (learner
rank 0's when training, else server 0's).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import ray
from ray.util.placement_group import PlacementGroup, placement_group

from asyncrl.config import Config
from asyncrl.launch.fleet import LaunchError
from asyncrl.run_spec import RunSpec

Slot = tuple[PlacementGroup, int]
"""Where a seat's actor is created: a placement group and the index of its bundle in it."""


@dataclass(frozen=True)
class Seat:
    """One fleet process as the launcher plans it, before Ray places it."""

    name: str  # replay, server_<i>, learner_<rank>
    role: str  # replay | server | learner
    index: int  # server index or learner rank
    bundle: dict[str, float]  # what it reserves ({} for the replay, which reserves nothing)


def plan_seats(cfg: Config, with_learner: bool) -> list[Seat]:
    """The replay, the servers and (when training) the learner ranks, with their bundles."""
    rc = cfg.launch.ray
    server = _bundle("server", rc.server_num_cpus, rc.server_num_gpus)
    seats = [Seat("replay", "replay", 0, {})]
    seats += [Seat(f"server_{i}", "server", i, server) for i in range(cfg.rollout.num_servers)]
    if with_learner:
        learner = _bundle("learner", rc.learner_num_cpus, rc.learner_num_gpus)
        seats += [
            Seat(f"learner_{r}", "learner", r, learner) for r in range(cfg.learner.world_size)
        ]
    return seats


def _bundle(role: str, num_cpus: float, num_gpus: float) -> dict[str, float]:
    bundle = {k: v for k, v in (("CPU", num_cpus), ("GPU", num_gpus)) if v > 0}
    if not bundle:
        raise LaunchError(
            f"launch.ray.{role}_num_cpus and launch.ray.{role}_num_gpus are both 0: a "
            "placement-group bundle must reserve something"
        )
    return bundle


def reserved(seats: list[Seat]) -> dict[str, float]:
    """What the whole fleet reserves, in CPUs and GPUs."""
    return {k: sum(s.bundle.get(k, 0) for s in seats) for k in ("CPU", "GPU")}


def spec_for_seat(spec: RunSpec, cfg: Config, seat: Seat) -> RunSpec:
    """The spec one actor gets: torch threads = launch.threads_per_process, or the CPUs its
    bundle reserves (at least 1)."""
    threads = cfg.launch.threads_per_process or max(1, int(seat.bundle.get("CPU", 0)))
    return replace(spec, threads=threads)


def place(seats: list[Seat], cfg: Config, groups: list[PlacementGroup]) -> dict[str, Slot]:
    """Create the placement groups and wait until Ray has placed them; returns each seat's
    slot. Loopback addresses need one node: one STRICT_PACK group. Otherwise the learner
    ranks get a group of their own (launch.ray.learner_strategy). Each group is appended to
    `groups` as it is created, so the caller removes it even when placing fails."""
    servers = [s for s in seats if s.role == "server"]
    learners = [s for s in seats if s.role == "learner"]
    if cfg.launch.allow_remote:
        plan = [(servers, "PACK"), (learners, cfg.launch.ray.learner_strategy)]
    else:
        plan = [(servers + learners, "STRICT_PACK")]
    slots: dict[str, Slot] = {}
    for members, strategy in plan:
        if members:
            pg = placement_group([s.bundle for s in members], strategy=strategy)
            groups.append(pg)
            slots |= {s.name: (pg, i) for i, s in enumerate(members)}
    slots["replay"] = slots[(learners or servers)[0].name]  # shares a bundle, reserves nothing
    _wait_placed(groups, reserved(seats), cfg)
    return slots


def _wait_placed(groups: list[PlacementGroup], reserves: dict[str, float], cfg: Config) -> None:
    timeout_s = cfg.launch.startup_timeout_s
    refs = [pg.ready() for pg in groups]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    if len(ready) < len(refs):
        one_node = (
            ""
            if cfg.launch.allow_remote
            else "; with loopback addresses the whole fleet must fit on one node "
            "(launch.allow_remote=true lets it spread)"
        )
        raise LaunchError(
            f"Ray could not place the fleet within {timeout_s:.0f}s: it reserves {reserves}, "
            f"the cluster has {ray.cluster_resources()} (launch.ray.*_num_cpus/_num_gpus)"
            + one_node
        )
