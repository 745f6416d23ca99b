"""A rollout server's engine and weight receiver without the rest of the server, as a process of
its own: `python engine_peer.py PORT MODEL DEVICE LORA_RANK OUT`.

It loads the transformers engine (`HFEngine`) on DEVICE and joins the learner's weight sync as
server 0, epoch 0, exactly as a rollout server does (`follow_learner` with a `SyncTarget` naming
the server, so learner rank 0 chooses the transport). After each version it applies (the engine
checks the delivery probe itself) it appends to OUT (JSON lines) the version and the engine's
log-probs of `IDS`; then how it ended (`closed`, or `error` with exit code 3). A separate process
because CUDA IPC cannot be opened by the process that exported it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from sync_peers import member_key

from asyncrl.config.learner import LoraConfig
from rollout_servers.engines.base import SyncTarget
from rollout_servers.engines.hf import HFEngine

IDS = [3, 9, 4, 11, 2, 8, 5, 7]


def main(port: int, model: str, device: str, lora_rank: int, out: Path) -> int:
    torch.set_num_threads(1)

    def write(record: dict) -> None:
        with out.open("a") as f:
            f.write(json.dumps(record) + "\n")

    lora = LoraConfig(rank=lora_rank, alpha=2.0 * lora_rank) if lora_rank else None
    engine = HFEngine(model, device=device, seed=0, lora=lora)
    write({"event": "started"})
    key = member_key(0, 0)
    target = SyncTarget("127.0.0.1", port, 1, 2, torch.device(device), 60.0, server_id=0, key=key)
    try:
        for applied in engine.follow_learner(target):
            scored = engine.probe_logprobs(IDS)
            assert scored is not None  # the transformers engine scores any ids
            logprobs = scored.float().cpu().tolist()
            write({"version": applied.version, "logprobs": logprobs})
    except Exception as e:  # the test reads how it ended
        write({"event": "error", "error": repr(e)[:500]})
        return 3
    write({"event": "closed"})
    return 0


if __name__ == "__main__":
    port, model, device, lora_rank, out = sys.argv[1:]
    sys.exit(main(int(port), model, device, int(lora_rank), Path(out)))
