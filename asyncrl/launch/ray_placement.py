"""Placement for the Ray launcher (`ray_cluster.py`): which fleet process reserves what, and the
placement groups that hold those reservations.

The GPUs come from the run's placement (`asyncrl.placement`, the same rule as the local
launcher's): a process on GPUs of its own gets a bundle with those GPUs (1 per learner rank,
`rollout.gpus_per_server` per server); the processes that share a GPU share one bundle with
one GPU, each actor taking a fraction of it (a server its `rollout.gpu_memory_fraction`, the
learner rank what the servers leave), so Ray shows all of them the same GPU. CPUs: each server
`launch.ray.server_num_cpus`, each learner rank `launch.ray.learner_num_cpus` (a shared bundle
reserves its members' sum).

- `launch.allow_remote=false` (the default, loopback sockets): one STRICT_PACK placement group
  with every bundle: the whole fleet on one node, every address `launch.host`.
- `launch.allow_remote=true`: the bundles with a learner rank in one placement group
  (`launch.ray.learner_strategy`), the others in another (PACK), and every service bound to
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
from asyncrl.placement import PlacementPlan, launch_placement, plan_placement
from asyncrl.run_spec import RunSpec

Slot = tuple[PlacementGroup, int]
"""Where a seat's actor is created: a placement group and the index of its bundle in it."""


@dataclass(frozen=True)
class Seat:
    """One fleet process as the launcher plans it, before Ray places it."""

    name: str  # replay, server_<i>, learner_<rank>
    role: str  # replay | server | learner
    index: int  # server index or learner rank
    bundle: dict[str, float]  # what its actor takes ({} for the replay, which takes nothing)
    gpus: tuple[int, ...] = ()  # its GPUs in the run's placement; seats sharing one share a bundle


def ray_placement(cfg: Config, with_learner: bool) -> PlacementPlan:
    """The run's placement under Ray: on this machine's GPUs (`launch_placement`), or, on an
    existing cluster (`launch.ray.address`) with `launch.gpus` set, on that many GPUs, which Ray
    checks when it places the bundles."""
    if cfg.launch.ray.address is not None and cfg.launch.gpus is not None:
        return plan_placement(cfg, cfg.launch.gpus, with_learner)
    return launch_placement(cfg, with_learner)


def plan_seats(cfg: Config, with_learner: bool, plan: PlacementPlan | None = None) -> list[Seat]:
    """The replay, the servers and (when training) the learner ranks, with what each actor
    takes (`plan`: the run's placement; default `ray_placement`). The plan's reward-model
    servers get no seat: the Ray launcher refuses a run with a reward model (`start_ray_fleets`)."""
    plan = ray_placement(cfg, with_learner) if plan is None else plan
    rc = cfg.launch.ray
    cpus = {"server": rc.server_num_cpus, "learner": rc.learner_num_cpus}
    seats = [Seat("replay", "replay", 0, {})]
    for p in plan.places:
        if p.role in ("replay", "reward_model"):
            continue
        gpus: float = len(p.gpus)
        if p.shared:
            if len(p.gpus) > 1:
                raise LaunchError(
                    f"{p.name} would share {len(p.gpus)} GPUs (rollout.gpus_per_server="
                    f"{cfg.rollout.gpus_per_server}): under launch.backend=ray a server on "
                    "several GPUs needs them to itself; raise launch.gpus"
                )
            gpus = p.memory_fraction or 0.0
        seats.append(Seat(p.name, p.role, p.index, _bundle(p.role, cpus[p.role], gpus), p.gpus))
    return seats


def _bundle(role: str, num_cpus: float, num_gpus: float) -> dict[str, float]:
    bundle = {k: v for k, v in (("CPU", num_cpus), ("GPU", num_gpus)) if v > 0}
    if not bundle:
        raise LaunchError(
            f"launch.ray.{role}_num_cpus is 0 and the {role} has no GPU: a placement-group "
            "bundle must reserve something"
        )
    return bundle


def bundles(seats: list[Seat]) -> list[tuple[dict[str, float], list[Seat]]]:
    """The placement-group bundles and the seats in each: one per seat, except that the seats
    sharing a GPU share one bundle (that GPU, their CPUs together)."""
    grouped: dict[object, list[Seat]] = {}
    for s in seats:
        if s.role != "replay":
            grouped.setdefault(s.gpus if s.gpus else s.name, []).append(s)
    out = []
    for key, members in grouped.items():
        cpus = sum(m.bundle.get("CPU", 0) for m in members)
        gpus = float(len(key)) if isinstance(key, tuple) else 0.0
        out.append(({k: v for k, v in (("CPU", cpus), ("GPU", gpus)) if v > 0}, members))
    return out


def reserved(seats: list[Seat]) -> dict[str, float]:
    """What the whole fleet reserves, in CPUs and GPUs."""
    return {k: sum(b.get(k, 0) for b, _ in bundles(seats)) for k in ("CPU", "GPU")}


def spec_for_seat(spec: RunSpec, cfg: Config, seat: Seat) -> RunSpec:
    """The spec one actor gets: torch threads = launch.threads_per_process, or the CPUs its
    bundle reserves (at least 1)."""
    threads = cfg.launch.threads_per_process or max(1, int(seat.bundle.get("CPU", 0)))
    return replace(spec, threads=threads)


def place(seats: list[Seat], cfg: Config, groups: list[PlacementGroup]) -> dict[str, Slot]:
    """Create the placement groups and wait until Ray has placed them; returns each seat's
    slot. Loopback addresses need one node: one STRICT_PACK group. Otherwise the bundles with
    a learner rank get a group of their own (launch.ray.learner_strategy). Each group is appended to
    `groups` as it is created, so the caller removes it even when placing fails."""
    learners = [s for s in seats if s.role == "learner"]
    servers = [s for s in seats if s.role == "server"]
    everything = bundles(seats)
    if cfg.launch.allow_remote:
        with_learner = [b for b in everything if any(m.role == "learner" for m in b[1])]
        others = [b for b in everything if b not in with_learner]
        plan = [(others, "PACK"), (with_learner, cfg.launch.ray.learner_strategy)]
    else:
        plan = [(everything, "STRICT_PACK")]
    slots: dict[str, Slot] = {}
    for members, strategy in plan:
        if members:
            pg = placement_group([b for b, _ in members], strategy=strategy)
            groups.append(pg)
            slots |= {s.name: (pg, i) for i, (_, seated) in enumerate(members) for s in seated}
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
            f"the cluster has {ray.cluster_resources()} (launch.ray.*_num_cpus, launch.gpus)"
            + one_node
        )
