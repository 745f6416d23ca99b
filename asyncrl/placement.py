"""Where every process of a run goes: its GPUs, its `CUDA_VISIBLE_DEVICES` and its share of a
shared GPU's memory, decided by the launcher before any process starts (`plan_placement`).

The rule. G = `launch.gpus` (None: every GPU this machine shows the launcher, `visible_gpus`;
`CUDA_VISIBLE_DEVICES` counts when set), L = learner ranks on a GPU (`learner.world_size`, 0
when `learner.device=cpu`, when G = 0 or when serving), T = `rollout.gpus_per_server`, and
servers go on GPUs unless `rollout.device=cpu` or G = 0.

1. Learner rank r runs on GPU r (one GPU per rank: NCCL refuses two ranks on one device).
2. Server i runs on the T GPUs starting at (L + i*T) mod G, counting on modulo G. Servers fill
   the GPUs after the learner's first; only when L + servers*T > G do they wrap onto GPUs
   already taken (the learner's first, then servers'). So with enough GPUs every process has
   GPUs of its own (`disaggregated`); with fewer, servers share GPUs (`colocated`; on one GPU
   everything is on GPU 0). GPUs past the last one used stay idle.
3. Memory: a server's engine may take `rollout.gpu_memory_fraction` of each of its GPUs. None
   (the default): 0.85 of a GPU it has alone; on a shared GPU the servers on it split evenly
   0.85, or 0.4 when a learner rank is on it too (so each of 2 servers on the learner's GPU
   takes 0.2). A server on several GPUs takes the smallest of its GPUs' shares. A learner
   rank's share is what the servers on its GPU leave (1 on a GPU of its own); the learner
   states it in its log and holds to it (`maybe_limit_gpu_memory`), as does an HF-engine
   server on a shared GPU (vLLM and SGLang take their fraction as their own option).
4. `CUDA_VISIBLE_DEVICES` of each process: its GPUs as the launcher's parent numbers them
   (entries of the launcher's own `CUDA_VISIBLE_DEVICES` when set, else their index), so every
   process calls its first GPU `cuda:0`; "" for a process on CPU (the replay too) when the
   machine has GPUs; untouched when it has none (the CPU default run is as it always was).
5. Reward-model servers (`reward_model_<k>`, k < `reward.num_servers`, only when
   `reward.model.path` is set) come after the learner's and the servers' GPUs: on CPU when
   `reward.model.device=cpu` or G = 0, else one GPU each, (L + S + k) mod G, with S =
   `rollout.num_servers` * T the servers' GPUs (0 when the servers are on CPU). So they have
   GPUs of their own when there are enough, else they share (on one GPU, GPU 0). Each takes
   `reward.model.gpu_memory_fraction` (0.1) of its GPU, shared or not (so it needs the same
   room on one GPU as on eight), and holds to it (`maybe_limit_gpu_memory`); on a GPU it
   shares, that share counts as a server's does: the servers' default shares of rule 3 stay as
   they are, a learner rank gets what servers and reward models leave (1 GPU, defaults: 1 -
   0.4 - 0.1 = 0.5), and the refusal below counts it.

Refused before anything starts, naming the keys (`PlacementError`): `launch.gpus` above the
GPUs present, `rollout.gpus_per_server` above `launch.gpus`, more learner ranks than GPUs, a
`cuda` device with no GPU (`reward.model.device` too, with a reward model), servers' and reward
models' fractions on one GPU above 1 (or leaving a learner rank less than `LEARNER_MIN_SHARE`).
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

from asyncrl.config import ConfigError

OWN_GPU_FRACTION = 0.85
"""Default share of a GPU's memory the engines on it take when no learner rank is on it."""
WITH_LEARNER_FRACTION = 0.4
"""Default share of a GPU's memory the engines on it take, together, next to a learner rank."""
LEARNER_MIN_SHARE = 0.1
"""Least share of its GPU's memory a learner rank may be left by the servers beside it."""


class PlacementError(ConfigError):
    """A placement that cannot work; the message names the config keys (the CLI reports it as
    it reports any bad config)."""


@dataclass(frozen=True)
class Placement:
    """One process of the run as placed."""

    name: str  # replay, reward_model_<k>, server_<i>, learner_<rank>
    role: str  # replay | reward_model | server | learner
    index: int  # reward-model or server index, or learner rank (0 for the replay)
    gpus: tuple[int, ...]  # the launcher's GPU numbers (0 .. launch.gpus-1); () on CPU
    cuda_visible_devices: str | None  # what it is started with; None: inherited unchanged
    memory_fraction: float | None  # server: its engine's share of each GPU; others: their share
    shared: bool  # another process of the run is on one of its GPUs

    @property
    def where(self) -> str:
        return "cpu" if not self.gpus else "gpu " + ",".join(map(str, self.gpus))


@dataclass(frozen=True)
class PlacementPlan:
    """Every process's `Placement`, as `plan_placement` decided them."""

    gpus: int  # GPUs the run uses (launch.gpus resolved)
    mode: str  # cpu | disaggregated | colocated
    places: tuple[Placement, ...]

    def place(self, name: str) -> Placement | None:
        return next((p for p in self.places if p.name == name), None)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able (launch.json keeps it; `from_dict` reads it back)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PlacementPlan:
        places = tuple(Placement(**p | {"gpus": tuple(p["gpus"])}) for p in data["places"])
        return cls(data["gpus"], data["mode"], places)

    def table(self) -> str:
        """The plan as printed at start: one line per process."""
        lines = [f"asyncrl: placement: {self.mode}, {self.gpus} GPU(s)"]
        w = max([12, *(len(p.name) for p in self.places)])  # reward_model_<k> is longer
        lines.append(f"  {'process':<{w}} {'where':<10} {'CUDA_VISIBLE_DEVICES':<21} memory")
        for p in self.places:
            cvd = "(inherited)" if p.cuda_visible_devices is None else repr(p.cuda_visible_devices)
            memory = "-" if p.memory_fraction is None else f"{p.memory_fraction:.2f}"
            memory += " shared" if p.shared else (" own" if p.gpus else "")
            lines.append(f"  {p.name:<{w}} {p.where:<10} {cvd:<21} {memory}")
        return "\n".join(lines)


class PlacementSetup(Protocol):
    """What `plan_placement` reads of the config (`asyncrl.config.Config`)."""

    @property
    def launch(self) -> Any: ...
    @property
    def rollout(self) -> Any: ...
    @property
    def learner(self) -> Any: ...
    @property
    def reward(self) -> Any: ...


def visible_gpus() -> int:
    """GPUs this process can use: none without an NVIDIA driver (torch is then not even
    imported, so a CPU launcher starts as fast as ever), else `torch.cuda.device_count()`
    (which honours `CUDA_VISIBLE_DEVICES` and does not initialise CUDA)."""
    driver = ("/proc/driver/nvidia/gpus", "/dev/nvidiactl", "/dev/nvidia0")
    if not any(Path(p).exists() for p in driver):  # (a container may lack one of them)
        return 0
    import torch

    return torch.cuda.device_count()


def plan_placement(
    cfg: PlacementSetup,
    gpus_present: int,
    with_learner: bool = True,
    parent_cvd: str | None = None,
) -> PlacementPlan:
    """Place the replay, the reward-model servers (with `reward.model.path`), the servers and
    (when training) the learner ranks by the rule of the module docstring. `gpus_present`:
    what the launcher sees (`visible_gpus`); `parent_cvd`: its own `CUDA_VISIBLE_DEVICES`
    (None: unset)."""
    rc, lr, rm = cfg.rollout, cfg.learner, cfg.reward.model
    reward_models = cfg.reward.num_servers if rm.path is not None else 0
    g, ranks = _gpus_and_ranks(cfg, gpus_present, with_learner, parent_cvd, reward_models)
    t, servers_on_gpu = rc.gpus_per_server, rc.device != "cpu" and g > 0
    learner_gpus = {f"learner_{r}": (r,) for r in range(ranks)}
    server_gpus = {
        f"server_{i}": tuple((ranks + i * t + j) % g for j in range(t)) if servers_on_gpu else ()
        for i in range(rc.num_servers)
    }
    after = ranks + (rc.num_servers * t if servers_on_gpu else 0)  # rule 5: after them all
    rm_on_gpu = rm.device != "cpu" and g > 0
    rm_gpus: dict[str, tuple[int, ...]] = {
        f"reward_model_{k}": ((after + k) % g,) if rm_on_gpu else () for k in range(reward_models)
    }
    fractions = _server_fractions(server_gpus, set(range(ranks)), rc.gpu_memory_fraction)
    fractions |= {name: rm.gpu_memory_fraction for name, gpus in rm_gpus.items() if gpus}
    _refuse_oversubscribed(server_gpus, rm_gpus, fractions, ranks, rc.gpu_memory_fraction)
    shares = _learner_shares({**server_gpus, **rm_gpus}, fractions, ranks)
    users = _users({**learner_gpus, **server_gpus, **rm_gpus})
    ids = _parent_ids(g, parent_cvd)

    def placed(
        name: str, role: str, index: int, gpus: tuple[int, ...], fraction: float | None
    ) -> Placement:
        cvd = None if gpus_present == 0 and g == 0 else ",".join(ids[i] for i in gpus)
        shared = any(users[i] > 1 for i in gpus)
        return Placement(name, role, index, gpus, cvd, fraction if gpus else None, shared)

    places = [placed("replay", "replay", 0, (), None)]
    for k, (name, gpus) in enumerate(rm_gpus.items()):
        places.append(placed(name, "reward_model", k, gpus, fractions.get(name)))
    for i, (name, gpus) in enumerate(server_gpus.items()):
        places.append(placed(name, "server", i, gpus, fractions.get(name)))
    for r, (name, gpus) in enumerate(learner_gpus.items()):
        places.append(placed(name, "learner", r, gpus, shares[r]))
    if with_learner and not ranks:  # learner ranks on CPU
        places += [placed(f"learner_{r}", "learner", r, (), None) for r in range(lr.world_size)]
    used = [p for p in places if p.gpus]
    mode = "cpu" if not used else "colocated" if any(p.shared for p in used) else "disaggregated"
    return PlacementPlan(g, mode, tuple(places))


def _gpus_and_ranks(
    cfg: PlacementSetup,
    gpus_present: int,
    with_learner: bool,
    parent_cvd: str | None,
    reward_models: int,
) -> tuple[int, int]:
    """(the GPUs to place on, the learner ranks that take one each), or PlacementError naming
    the key that asks for more than there is."""
    lc, rc, lr, rm = cfg.launch, cfg.rollout, cfg.learner, cfg.reward.model
    g = gpus_present if lc.gpus is None else lc.gpus
    if g > gpus_present:
        raise PlacementError(
            f"launch.gpus={g} but this machine shows {gpus_present} GPU(s)"
            + (f" (CUDA_VISIBLE_DEVICES={parent_cvd!r})" if parent_cvd is not None else "")
        )
    for key, device, needed in (
        ("rollout.device", rc.device, True),
        ("learner.device", lr.device, with_learner),
        ("reward.model.device", rm.device, reward_models > 0),
    ):
        if needed and device == "cuda" and g == 0:
            raise PlacementError(f"{key}=cuda but launch.gpus resolves to 0 (no GPU to run on)")
    ranks = lr.world_size if with_learner and lr.device != "cpu" and g > 0 else 0
    if ranks > g:
        raise PlacementError(
            f"learner.world_size={ranks} needs a GPU per rank but launch.gpus={g} "
            "(or set learner.device=cpu)"
        )
    t, servers_on_gpu = rc.gpus_per_server, rc.device != "cpu" and g > 0
    if servers_on_gpu and t > g:
        raise PlacementError(f"rollout.gpus_per_server={t} exceeds launch.gpus={g}")
    return g, ranks


def _users(gpus_of: dict[str, tuple[int, ...]]) -> dict[int, int]:
    """How many processes are on each GPU."""
    users: dict[int, int] = {}
    for gpus in gpus_of.values():
        for i in gpus:
            users[i] = users.get(i, 0) + 1
    return users


def _server_fractions(
    server_gpus: dict[str, tuple[int, ...]], learner_gpus: set[int], fraction: float | None
) -> dict[str, float]:
    """Each server's share of each of its GPUs (rule 3)."""
    users = _users(server_gpus)
    if fraction is None:
        budget = {
            i: WITH_LEARNER_FRACTION if i in learner_gpus else OWN_GPU_FRACTION for i in users
        }
        fractions = {
            n: _floor4(min(budget[i] / users[i] for i in gs)) for n, gs in server_gpus.items() if gs
        }
    else:
        fractions = {n: fraction for n, gs in server_gpus.items() if gs}
    return fractions


def _refuse_oversubscribed(
    server_gpus: dict[str, tuple[int, ...]],
    rm_gpus: dict[str, tuple[int, ...]],
    fractions: dict[str, float],
    ranks: int,
    fraction: float | None,
) -> None:
    """Refuse a GPU whose servers' and reward models' shares (`fractions`) add up to more than
    it has, or leave a learner rank on it less than `LEARNER_MIN_SHARE`; the message names the
    keys that set those shares."""
    servers, rms = _users(server_gpus), _users(rm_gpus)
    for i in sorted(servers.keys() | rms.keys()):
        total = sum(fractions[n] for n, gs in server_gpus.items() if i in gs)
        total += sum(fractions[n] for n, gs in rm_gpus.items() if i in gs)
        limit = 1 - LEARNER_MIN_SHARE if i < ranks else 1.0
        if total <= limit + 1e-9:
            continue
        who = f"learner rank {i} less than {LEARNER_MIN_SHARE}" if i < ranks else ""
        parts, lower = [], []
        if i in servers:
            parts.append(f"rollout.gpu_memory_fraction={fraction} x {servers[i]} server(s)")
            lower.append("rollout.gpu_memory_fraction or rollout.num_servers")
        if i in rms:
            rm_fraction = next(fractions[n] for n, gs in rm_gpus.items() if i in gs)
            parts.append(
                f"reward.model.gpu_memory_fraction={rm_fraction} x {rms[i]} reward model(s)"
            )
            lower.append("reward.model.gpu_memory_fraction or reward.num_servers")
        raise PlacementError(
            f"{' + '.join(parts)} on GPU {i} adds up to {total:.2f}: more than the GPU has"
            + (f" (it would leave {who})" if who else "")
            + f" (lower {', '.join(lower)}, or raise launch.gpus)"
        )


def _learner_shares(
    shared_with: dict[str, tuple[int, ...]], fractions: dict[str, float], ranks: int
) -> list[float]:
    """Each learner rank's share of its GPU: what the servers and reward models on it leave."""
    taken = [0.0] * ranks
    for name, gpus in shared_with.items():
        for i in gpus:
            if i < ranks:
                taken[i] += fractions[name]
    return [round(1 - t, 4) for t in taken]


def _floor4(x: float) -> float:
    return math.floor(x * 10_000) / 10_000


def _parent_ids(g: int, parent_cvd: str | None) -> list[str]:
    """The names the launcher's parent gives its GPUs 0 .. g-1: its CUDA_VISIBLE_DEVICES
    entries when set (indices or UUIDs), else the indices themselves."""
    if parent_cvd is None:
        return [str(i) for i in range(g)]
    entries = [e.strip() for e in parent_cvd.split(",") if e.strip()]
    if len(entries) < g:
        raise PlacementError(
            f"launch.gpus={g} but CUDA_VISIBLE_DEVICES={parent_cvd!r} names {len(entries)} GPU(s)"
        )
    return entries[:g]


def placement_env(place: Placement | None) -> dict[str, str]:
    """What a process's placement puts in its environment: its CUDA_VISIBLE_DEVICES (nothing
    when it inherits the launcher's: a machine without GPUs)."""
    if place is None or place.cuda_visible_devices is None:
        return {}
    return {"CUDA_VISIBLE_DEVICES": place.cuda_visible_devices}


def launch_placement(cfg: PlacementSetup, with_learner: bool = True) -> PlacementPlan:
    """`plan_placement` for this machine (its GPUs, the launcher's CUDA_VISIBLE_DEVICES)."""
    return plan_placement(cfg, visible_gpus(), with_learner, os.environ.get("CUDA_VISIBLE_DEVICES"))


def maybe_limit_gpu_memory(place: Placement | None, device: Any) -> float | None:
    """State this process's placement in its log and, on a shared GPU, cap its caching
    allocator at its share (`torch.cuda.set_per_process_memory_fraction`); a process on CPU is
    left untouched. A reward model holds to its share on a GPU of its own too (rule 5). Returns
    the cap applied, if any."""
    log = logging.getLogger("asyncrl.placement")
    who = "this process" if place is None else place.name
    if place is None or getattr(device, "type", str(device)) != "cuda":
        log.info("%s runs on %s", who, device)
        return None
    capped = place.shared or place.role == "reward_model"
    fraction = place.memory_fraction if capped else None
    cvd = place.cuda_visible_devices
    if fraction is None or fraction >= 1:
        log.info("%s on %s (CUDA_VISIBLE_DEVICES=%s), a GPU of its own", who, device, cvd)
        return None
    import torch

    torch.cuda.set_per_process_memory_fraction(fraction, device)
    log.info(
        "%s on %s (CUDA_VISIBLE_DEVICES=%s), %s: its share is %.2f of the GPU's memory "
        "(enforced: torch.cuda.set_per_process_memory_fraction)",
        who,
        device,
        cvd,
        "shared" if place.shared else "a GPU of its own",
        fraction,
    )
    return fraction
