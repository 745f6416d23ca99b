"""What a launcher tells every process of a run: where things are (decided once, read by all).

The launcher resolves addresses and the model directory before it starts any role. The local
launcher writes the spec to `run_dir/launch.json` and starts each process with the path; the
Ray launcher hands it to each actor by value (a run directory need not be shared between
nodes) and writes `launch.json` too, for people and tools. No process ever guesses a port or a
path.

The spec also carries the run's placement (`asyncrl.placement.PlacementPlan`): each process
reads its own (`own_place`) for its share of a shared GPU's memory, and `launch.json` keeps it
for people and tools.

What differs between the processes of a run is no field here: a process's role, index and (a
rollout server's) epoch travel in its `asyncrl.launch.worker.ProcessRole`, on its command line.
The spec is written once per run, while a server's epoch changes at each of its restarts.
Secrets travel in neither (`asyncrl.wire.auth`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from asyncrl.placement import Placement, PlacementPlan


@dataclass(frozen=True)
class RunSpec:
    run_dir: str  # the run directory (config.yaml, metrics.jsonl, logs/, final/)
    model_path: str  # Hugging Face model directory every fleet loads at version 0
    replay_address: str  # ZeroMQ address of the replay service
    sync_host: str  # rendezvous host of the weight-sync group (learner rank 0)
    sync_port: int  # rendezvous port of the weight-sync group; 0: no learner (serving only)
    learner_master_port: int  # rendezvous port of the learner's FSDP process group
    threads: int  # torch intra-op threads per compute process
    placement: PlacementPlan | None = None  # every process's GPUs and memory share
    reward_model_addresses: tuple[str, ...] = ()  # ZeroMQ address of each reward-model server

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=1))

    @classmethod
    def load(cls, path: str | Path) -> RunSpec:
        data = json.loads(Path(path).read_text())
        if "reward_model_addresses" in data:  # JSON has lists, the spec a (hashable) tuple
            data["reward_model_addresses"] = tuple(data["reward_model_addresses"])
        if data.get("placement") is not None:
            data["placement"] = PlacementPlan.from_dict(data["placement"])
        return cls(**data)

    def own_place(self, name: str) -> Placement | None:
        """Process `name`'s placement (None: a spec written without one)."""
        return None if self.placement is None else self.placement.place(name)

    @property
    def config_path(self) -> Path:
        return Path(self.run_dir) / "config.yaml"
