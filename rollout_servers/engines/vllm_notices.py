"""The vLLM worker's one-way notices to its rollout server (PUSH/PULL over an ipc socket).

The weight receiver runs inside vLLM's worker process (`vllm_worker`) and tells the server
(`vllm`) what happened to each version; the server applies a staged version through vLLM's
`collective_rpc`. These messages never reach the replay, so they live here rather than in
`asyncrl.wire.protocol`, with the same codec (MessagePack, validated on decode). The other way, the
server's one message to the worker is its join (`vllm_join.JoinWeightSync`).
"""

from __future__ import annotations

from asyncrl.wire.codec import message


@message("weights_staged")
class WeightsStaged:
    version: int  # the policy version now staged in the vLLM worker, ready to apply
    receive_s: float  # seconds the broadcast of this version took
    probe: list[
        float
    ]  # the delivery probe as `DeliveryProbe.to_wire()` (log-probs, then tolerance); [] if none


@message("weight_receiver_closed")
class WeightReceiverClosed:
    version: int  # the last version the worker staged (-1: none); the learner closed the group


@message("weight_receiver_failed")
class WeightReceiverFailed:
    error: str  # the exception and traceback that stopped the worker's weight receiver
