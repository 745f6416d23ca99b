"""The part of the vLLM engine that runs inside vLLM's worker process (a worker extension).

vLLM mixes `WeightSyncExtension` into its worker class (`worker_extension_cls`); the rollout
server calls its methods with `collective_rpc`. Weights never travel through that RPC: the
worker itself joins the learner's weight-sync group (`asyncrl.weights.sync`, gloo on CPU, NCCL
on CUDA) as the server's rank, so a broadcast lands directly in the process that holds the model.
What it joins is one typed message from the server (`vllm_join.JoinWeightSync`).

One version, step by step:
1. a receiver thread here blocks in the broadcast while the engine keeps generating, and stages
   the whole version (every bucket) in memory;
2. it tells the server over a ZeroMQ PUSH socket (a typed `WeightsStaged` notice, see
   `vllm_notices`), then waits;
3. the server stops admitting requests, lets in-flight ones finish on the old version, and calls
   `asyncrl_apply`: each bucket goes through the model's `load_weights` inside vLLM's layerwise
   reload (which restores checkpoint-format parameters and re-runs each layer's post-load
   processing, e.g. the CPU backend's weight prepacking);
4. the server resets the prefix cache, tags new requests with the new version and resumes; the
   receiver thread goes back to step 1.
A version is staged entirely before any of it is applied, so a failed or partial broadcast
never reaches the model. With LoRA a version carries adapters, and step 3 loads the adapted
layers merged into the checkpoint's base weights instead (`vllm_lora`).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import traceback
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
import zmq

from asyncrl.dtypes import torch_dtype
from asyncrl.weights.group import join_sync_group
from asyncrl.weights.receiver import ReceivedVersion, WeightReceiver
from asyncrl.wire.sockets import send_msg
from rollout_servers.engines.vllm_join import JoinWeightSync, param_specs, unpack_join
from rollout_servers.engines.vllm_lora import MergedVersions
from rollout_servers.engines.vllm_notices import (
    WeightReceiverClosed,
    WeightReceiverFailed,
    WeightsStaged,
)


@contextlib.contextmanager
def _quiet_partial(lora: MergedVersions | None) -> Iterator[None]:
    """A LoRA version reloads only the adapted layers: vLLM's reload then warns "Failed to load
    weights" for every other layer (restored as they were, by design). Silence that, only then."""
    logger = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    level = logger.level
    if lora is not None:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


class WeightSyncExtension:
    """Methods vLLM adds to its worker; `self` is the worker (model_runner, device, vllm_config)."""

    # the worker's attributes these methods use (annotations only: vLLM's worker sets them)
    model_runner: Any  # vLLM's GPU/CPU model runner (`.model`, `.model_config`)
    device: torch.device
    vllm_config: Any

    def asyncrl_join_sync_group(self, payload: bytes) -> None:
        """Start the receiver thread: it joins the weight sync as `payload` says (a packed
        `vllm_join.JoinWeightSync`: as server `server_id`, `epoch`, or as `rank` of a plain
        group) and stages each version. With `lora`, versions carry adapters, merged here
        (`vllm_lora.MergedVersions`) into the checkpoint's base weights."""
        join = unpack_join(payload)
        self._asyncrl_lora = None
        if join.lora is not None:
            lora = join.lora
            # checkpoint layers vLLM fuses into one (q/k/v -> qkv_proj, ...), from the model
            fused = getattr(self.model_runner.model, "packed_modules_mapping", {}).values()
            self._asyncrl_lora = MergedVersions(
                lora.model_path, lora.targets, lora.scale, torch_dtype(lora.dtype), fused
            )
        self._asyncrl_specs = param_specs(join)
        self._asyncrl_staged: ReceivedVersion | None = None
        self._asyncrl_applied = threading.Event()
        self._asyncrl_thread = threading.Thread(
            target=self._asyncrl_receive_loop,
            args=(join,),
            daemon=True,
            name="asyncrl-weight-receiver",
        )
        self._asyncrl_thread.start()

    def _asyncrl_receive_loop(self, join: JoinWeightSync) -> None:
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        notify = ctx.socket(zmq.PUSH)
        notify.setsockopt(zmq.LINGER, 2000)
        notify.connect(join.notify_address)

        staged = -1
        try:
            device = self.device if self.device.type == "cuda" else torch.device("cpu")
            group = join_sync_group(
                join.host,
                join.port,
                join.rank,
                join.world_size,
                device,
                join.timeout_s,
                join.server_id,
                join.epoch,
                key=join.sync_key,
            )
            receiver = WeightReceiver(group, self._asyncrl_specs)
            while True:
                start = time.perf_counter()
                got = receiver.receive()
                if got is None:
                    send_msg(notify, WeightReceiverClosed(staged), auth=None)
                    return
                self._asyncrl_staged, staged = got, got.version
                self._asyncrl_applied.clear()
                probe = [] if got.probe is None else got.probe.to_wire().tolist()
                took = time.perf_counter() - start
                send_msg(notify, WeightsStaged(got.version, took, probe), auth=None)
                self._asyncrl_applied.wait()  # the learner's next broadcast waits for this one
        except BaseException as e:  # the server surfaces it and stops
            send_msg(notify, WeightReceiverFailed(f"{e!r}\n{traceback.format_exc()}"), auth=None)
        finally:
            notify.close()

    def asyncrl_apply(self, version: int) -> float:
        """Load the staged version into the model, bucket by bucket; returns seconds taken.
        Called only while no request is in flight (the server drains first)."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        staged = self._asyncrl_staged
        if staged is None or staged.version != version:
            have = None if staged is None else staged.version
            raise RuntimeError(f"asyncrl_apply({version}): the staged version is {have}")
        start = time.perf_counter()
        lora = self._asyncrl_lora
        buckets: Sequence[Iterable[tuple[str, torch.Tensor]]] = staged.buckets
        if lora is not None:  # adapters checked before the model is touched, merged lazily
            buckets = [lora.weights(staged.weights)]
        model = self.model_runner.model
        with set_current_vllm_config(self.vllm_config), torch.no_grad(), _quiet_partial(lora):
            initialize_layerwise_reload(model)
            for bucket in buckets:
                model.load_weights(bucket)
            finalize_layerwise_reload(model, self.model_runner.model_config)
        staged.release()  # loaded: the next version may reuse the staging memory
        self._asyncrl_staged = None
        self._asyncrl_applied.set()
        return time.perf_counter() - start
