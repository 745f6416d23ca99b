"""The Ray launcher (`launch.backend=ray`): the local launcher's fleets as Ray actors.

Ray schedules; it carries neither trajectories nor weights. Every fleet process becomes one
`FleetProcess` actor that runs the same role function as a local process
(`asyncrl.launch.worker.run_process`) on its main thread, so the data plane is ZeroMQ and
torch.distributed exactly as under `launch.backend=local`.

Placement (what `start_ray_fleets` asks Ray for) is `asyncrl.launch.ray_placement`: the run's
placement (`asyncrl.placement`, as under the local launcher) as bundles, the processes that
share a GPU in one bundle with fractional GPUs; one STRICT_PACK placement group on loopback, two
groups (learner ranks, servers) with `launch.allow_remote=true`; the replay reserves nothing
and shares the first bundle. Ray sets each GPU actor's CUDA_VISIBLE_DEVICES to its bundle's
GPU(s); an actor on CPU gets CUDA_VISIBLE_DEVICES="" when the plan hides the GPUs from it.

`start_ray_fleets` runs as stages: `plan_seats` (who reserves what), `connect` (an existing
cluster, or a local one for the run), `place` (placement groups), `create_actor` and
`locate_actors`, `discover_spec`, `run_roles`. Addresses are discovered, not configured: the
replay's actor picks a free port on its node, learner rank 0's actor picks the FSDP rendezvous
and weight-sync ports on its node, and the launcher builds the `RunSpec` from them and hands
it, with the config, to every actor by value (a run directory need not be shared for that).

Failures: as under the local launcher (`asyncrl.launch.failures`), the first member to die
is named and the deaths after it are listed (each member is a `ray_members.RayMember`). A check stamps each run that has returned or
failed (an actor's death fails its run), and `RayFleet.wait` wakes on the first such report
(`ray.wait`). Ray reports a killed actor later than the errors its death causes in its peers,
so deaths whose logs are on this machine are ordered by their logs' last writes (a follower
writes its traceback after the death that caused it); others in the order Ray reports them.

Restarts (`restarts.ServerRestarts` decides when): `RayFleet.retire` kills a dead or hung server's
actor (`ray.kill`), which frees its bundle, and `start_server` creates a new actor in that
bundle and runs the server role in it as its next epoch (`asyncrl.launch.worker.ProcessRole`),
with that epoch's key in its environment.

Stopping (at the end, on Ctrl-C, on a failure): SIGTERM to each running actor's process (by a
zero-CPU task pinned to its node), so roles stop as they do locally and write their stats;
after a grace period `ray.kill` for every actor (no interpreter teardown, see
`asyncrl.launch.worker.exit_now`); the placement groups are removed; a local cluster started
for the run is shut down. An interrupt first SIGTERMs the learner ranks alone
(`RayFleet.stop_learners`) and waits for their checkpoint (`asyncrl.launch.interrupt`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import ray
from ray.exceptions import GetTimeoutError, RayError
from ray.util.placement_group import PlacementGroup, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from asyncrl.config import Config
from asyncrl.launch.failures import death_order
from asyncrl.launch.fleet import (
    LaunchError,
    client_key,
    learner_env,
    process_env,
    wait_for_replay,
)
from asyncrl.launch.ray_actors import (
    FleetProcess,
    Location,
    on_node,
    replay_answers_on_node,
    replay_health_on_node,
    signal_processes,
)
from asyncrl.launch.ray_connect import connect
from asyncrl.launch.ray_members import RayMember, ray_reason
from asyncrl.launch.ray_placement import (
    Seat,
    Slot,
    place,
    plan_seats,
    ray_placement,
    reserved,
    spec_for_seat,
)
from asyncrl.launch.worker import ProcessRole
from asyncrl.placement import placement_env
from asyncrl.run_spec import RunSpec
from asyncrl.weights.shm import sweep_dead_segments
from asyncrl.wire.auth import auth_env, read_secret
from asyncrl.wire.protocol import ServerHealth
from asyncrl.wire.sockets import tcp_address


@dataclass
class RayFleet:
    spec: RunSpec
    owns_connection: bool  # ray.init was ours: shut it down (and a local cluster with it)
    cfg: Config
    members: list[RayMember] = field(default_factory=list)
    placement_groups: list[PlacementGroup] = field(default_factory=list)
    slots: dict[str, Slot] = field(default_factory=dict)  # by seat name
    seats: list[Seat] = field(default_factory=list)  # as planned at the start
    stopped: bool = False
    checks: int = 0  # how many times every member's run has been polled
    death_notice_lag_s: float = 10.0
    """Ray reports a killed actor's death late: in CI (stop 37) learner rank 0 had server_0
    declared dead 0.8 s after its SIGKILL and the launcher named that, not the death."""

    def member(self, name: str) -> RayMember:
        return next(m for m in self.members if m.name == name)

    def retire(self, name: str) -> None:
        """Kill the actor of `name` (hung or not; its bundle is freed) and stop watching it."""
        m = self.member(name)
        with contextlib.suppress(RayError, ValueError):
            ray.kill(m.actor, no_restart=True)
        self.members.remove(m)

    def start_reward_model(self, index: int, epoch: int) -> None:
        """Never called: `start_ray_fleets` refuses a run with a reward model."""
        raise LaunchError("the Ray launcher does not run reward-model servers")

    def start_server(self, index: int, epoch: int) -> None:
        """A new actor for server `index` in its bundle, running the server role as `epoch`
        (located as it starts, without waiting here: `locate` runs before `run`)."""
        slot = self.slots[f"server_{index}"]
        seat = next(s for s in self.seats if s.name == f"server_{index}")
        create_actor(self, seat, slot, self.cfg)
        m = self.members[-1]
        m.locating = m.actor.locate.remote()
        spec = spec_for_seat(self.spec, self.cfg, seat)
        key = auth_env(read_secret(self.spec.run_dir), f"server_{index}", epoch)  # its epoch's
        m.running = m.actor.run.remote(ProcessRole("server", index, epoch), spec, self.cfg, key)

    def server_health(self) -> list[ServerHealth] | None:
        """Asked from the replay's node (the launcher may not reach a loopback address); None
        when no answer comes back."""
        replay = self.member("replay")
        probe = replay_health_on_node.options(scheduling_strategy=on_node(replay.at.node_id))
        try:
            return ray.get(probe.remote(self.spec.replay_address, client_key(self.spec)), timeout=5)
        except (GetTimeoutError, RayError):
            return None

    def _poll(self) -> None:
        """One check: stamp every member whose run has returned or failed since the last (and
        locate restarted actors that have started)."""
        self.checks += 1
        now = time.monotonic()
        for m in [m for m in self.members if m.locating is not None]:
            if ray.wait([m.locating], timeout=0)[0]:
                with contextlib.suppress(RayError):
                    m.where = ray.get(m.locating)
                m.locating = None
        running = [m for m in self.members if m.running is not None and not m.ended]
        if running:
            refs = [m.running for m in running]
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
            for m in running:
                if m.running in ready:
                    m.settle(self.checks, now)

    def failures(self) -> list[RayMember]:
        self._poll()
        return death_order([m for m in self.members if m.failed])

    def wait(self, timeout_s: float) -> bool:
        """Until Ray reports a run returned or failed (an actor's death included)."""
        running = [m.running for m in self.members if m.running is not None and not m.ended]
        if not running:
            return False
        ray.wait(running, num_returns=1, timeout=timeout_s)
        return True

    def learners_finished(self) -> bool:
        self._poll()
        return all(m.exit_code == 0 for m in self.members if m.seat.role == "learner")

    def stop_learners(self) -> None:
        """SIGTERM every learner rank's process that still runs (as `stop_all` does)."""
        with contextlib.suppress(RayError):
            self._poll()
            learners = [m for m in self.members if m.seat.role == "learner" and not m.ended]
            _signal([m.where for m in learners if m.where is not None], signal.SIGTERM, 10.0)

    def stop_all(self, grace_s: float = 10.0) -> None:
        """SIGTERM every running role, wait up to `grace_s`, then kill every actor, remove
        the placement groups and disconnect (stopping a cluster started for the run)."""
        if self.stopped:
            return
        self.stopped = True
        with contextlib.suppress(RayError):
            self._poll()
            running = [m for m in self.members if m.running is not None and not m.ended]
            _signal([m.where for m in running if m.where is not None], signal.SIGTERM, grace_s)
            if running:
                refs = [m.running for m in running]
                ray.wait(refs, num_returns=len(refs), timeout=grace_s)
        for m in self.members:
            with contextlib.suppress(RayError, ValueError):
                ray.kill(m.actor, no_restart=True)
        for pg in self.placement_groups:
            with contextlib.suppress(RayError, ValueError):
                remove_placement_group(pg)
        if self.owns_connection:
            ray.shutdown()
        sweep_dead_segments()  # a killed learner's segments, when it ran on this machine


def _signal(where: list[Location], sig: int, timeout_s: float) -> None:
    """Send `sig` to these processes, by one zero-CPU task on each of their nodes."""
    by_node: dict[str, list[int]] = {}
    for w in where:
        by_node.setdefault(w.node_id, []).append(w.pid)
    refs = [
        signal_processes.options(scheduling_strategy=on_node(node)).remote(pids, sig)
        for node, pids in by_node.items()
    ]
    if refs:
        ray.wait(refs, num_returns=len(refs), timeout=timeout_s)


def start_ray_fleets(
    cfg: Config, run_dir: Path, model_path: str, with_learner: bool = True
) -> RayFleet:
    """Start the fleets as Ray actors (the replay first; once it answers, the servers and the
    learner ranks); on any failure stop what was started and raise LaunchError."""
    if cfg.reward.model.path is not None:
        raise LaunchError(
            "reward.model.path: the reward-model fleet runs under launch.backend=local only "
            "for now (the Ray launcher does not start it)"
        )
    plan = ray_placement(cfg, with_learner)  # refused here, before any actor starts
    print(plan.table() + "\n  (Ray sets each GPU actor's CUDA_VISIBLE_DEVICES)", flush=True)
    seats = plan_seats(cfg, with_learner, plan)
    spec = RunSpec(
        run_dir=str(run_dir.resolve()),
        model_path=str(Path(model_path).resolve()),
        replay_address="",  # discovered below, once the actors run
        sync_host="",
        sync_port=0,
        learner_master_port=0,
        threads=1,
        placement=plan,
    )
    owns = connect(cfg.launch.ray, reserved(seats), loopback=not cfg.launch.allow_remote)
    fleet = RayFleet(spec, owns_connection=owns, cfg=cfg, seats=seats)
    try:
        slots = fleet.slots = place(seats, cfg, fleet.placement_groups)
        for seat in seats:
            create_actor(fleet, seat, slots[seat.name], cfg)
        locate_actors(fleet, cfg.launch.startup_timeout_s)
        fleet.spec = discover_spec(fleet, cfg, with_learner)
        run_roles(fleet, cfg)
    except RayError as e:  # an actor lost while it was being set up
        fleet.stop_all()
        raise LaunchError(f"the Ray fleet failed to start: {ray_reason(e)}") from e
    except BaseException:
        fleet.stop_all()
        raise
    nodes = sorted({m.at.node_ip for m in fleet.members})
    print(f"asyncrl: Ray actors placed on {len(nodes)} node(s): {', '.join(nodes)}", flush=True)
    return fleet


def create_actor(fleet: RayFleet, seat: Seat, slot: Slot, cfg: Config) -> None:
    """Create (not yet run) the actor of one seat in its placement-group bundle."""
    pg, index = slot
    log_path = Path(fleet.spec.run_dir) / "logs" / f"{seat.name}.log"
    env = process_env(spec_for_seat(fleet.spec, cfg, seat), seat.name)
    if not seat.gpus:  # Ray leaves an actor without GPUs every GPU: hide them as planned
        env |= placement_env(fleet.spec.own_place(seat.name))
    actor = FleetProcess.options(  # type: ignore[attr-defined]
        num_cpus=seat.bundle.get("CPU", 0),
        num_gpus=seat.bundle.get("GPU", 0),
        scheduling_strategy=PlacementGroupSchedulingStrategy(
            pg, placement_group_bundle_index=index
        ),
        runtime_env={"env_vars": env},
    ).remote(str(log_path), os.getcwd())
    fleet.members.append(RayMember(seat, actor, log_path))


def locate_actors(fleet: RayFleet, timeout_s: float) -> None:
    """Wait until every actor runs and learn where (LaunchError naming one that cannot)."""
    deadline = time.monotonic() + timeout_s
    refs = [m.actor.locate.remote() for m in fleet.members]
    for m, ref in zip(fleet.members, refs, strict=True):
        try:
            m.where = ray.get(ref, timeout=max(0.0, deadline - time.monotonic()))
        except GetTimeoutError:
            raise LaunchError(f"Ray actor {m.name} did not start within {timeout_s:.0f}s") from None
        except RayError as e:
            raise LaunchError(f"Ray actor {m.name} could not start: {ray_reason(e)}") from None


def discover_spec(fleet: RayFleet, cfg: Config, with_learner: bool) -> RunSpec:
    """The run's addresses: ports picked free on the replay's and learner rank 0's nodes,
    hosts loopback (launch.host) or, with allow_remote, those nodes' IPs. Saved as
    run_dir/launch.json for people and tools; the actors get it by value."""
    lc = cfg.launch

    def host(m: RayMember) -> str:
        return m.at.node_ip if lc.allow_remote else lc.host

    replay = fleet.member("replay")
    port = lc.replay_port or ray.get(replay.actor.free_ports.remote(host(replay), 1))[0]
    spec = replace(fleet.spec, replay_address=tcp_address(host(replay), port))
    if with_learner:
        rank0 = fleet.member("learner_0")
        master_port, sync_port = ray.get(rank0.actor.free_ports.remote(host(rank0), 2))
        spec = replace(
            spec,
            sync_host=host(rank0),
            sync_port=lc.weight_sync_port or sync_port,
            learner_master_port=master_port,
        )
    spec.save(Path(spec.run_dir) / "launch.json")
    return spec


def run_roles(fleet: RayFleet, cfg: Config) -> None:
    """Start every role: the replay, and once it answers (probed from its node), the servers
    and the learner ranks (with their torchrun-style environment)."""
    spec = fleet.spec
    replay = fleet.member("replay")
    replay.running = replay.actor.run.remote(ProcessRole("replay"), spec, cfg, {})
    probe = replay_answers_on_node.options(scheduling_strategy=on_node(replay.at.node_id))

    def answers() -> bool:
        try:
            return ray.get(probe.remote(spec.replay_address, client_key(spec)), timeout=10)
        except GetTimeoutError:
            return False

    wait_for_replay(fleet, answers, cfg.launch.startup_timeout_s)
    world = cfg.learner.world_size
    for m in fleet.members:
        seat, env = m.seat, {}
        if seat.role == "replay":
            continue
        if seat.role == "learner":
            # Ray shows each rank only its own GPUs, so its device is always cuda:0
            env = learner_env(seat.index, world, spec.sync_host, spec.learner_master_port, 0)
            m.essential_until_end = False  # learner ranks finishing (code 0) ends the run
        who = ProcessRole(seat.role, seat.index if seat.role == "server" else 0)
        m.running = m.actor.run.remote(who, spec_for_seat(spec, cfg, seat), cfg, env)
