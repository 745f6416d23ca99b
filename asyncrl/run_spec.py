"""What a launcher tells every process of a run: where things are (decided once, read by all).

The launcher resolves addresses and the model directory before it starts any role. The local
launcher writes the spec to `run_dir/launch.json` and starts each process with the path; the
Ray launcher hands it to each actor by value (a run directory need not be shared between
nodes) and writes `launch.json` too, for people and tools. No process ever guesses a port or a
path.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class RunSpec:
    run_dir: str  # the run directory (config.yaml, metrics.jsonl, logs/, final/)
    model_path: str  # Hugging Face model directory every fleet loads at version 0
    replay_address: str  # ZeroMQ address of the replay service
    sync_host: str  # rendezvous host of the weight-sync group (learner rank 0)
    sync_port: int  # rendezvous port of the weight-sync group; 0: no learner (serving only)
    learner_master_port: int  # rendezvous port of the learner's FSDP process group
    threads: int  # torch intra-op threads per compute process

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=1))

    @classmethod
    def load(cls, path: str | Path) -> RunSpec:
        return cls(**json.loads(Path(path).read_text()))

    @property
    def config_path(self) -> Path:
        return Path(self.run_dir) / "config.yaml"
