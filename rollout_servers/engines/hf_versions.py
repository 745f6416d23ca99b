"""The transformers engine's weights, and the gate a weight version passes to reach them.

`HFVersionGate` is the base of `hf.HFEngine` (which adds the request queue and the sampling
loop). It follows the learner (`follow_learner`, on the server's weight-receiver thread) and
applies each version entirely or not at all, the `Engine` invariants of `base.py`:
- a received version waits in one slot (`_Incoming`) until the sampling loop takes it: between
  two decode steps (`weight_update_mode="inflight"`: later tokens carry the new version), or
  once no row is live, admitting none meanwhile (`"drain"`); with no sampling loop running the
  receiver applies it itself (`_hand_over`);
- whoever applies it holds the lock the sampling loop holds while rows are live, and copies the
  weights and scores the delivery probe before another token is sampled (`_apply`); weights
  that fail the check, or a copy that failed halfway, fail every later request (`_broken`);
- with LoRA (`learner.lora.rank > 0`) a version carries adapters, merged into a copy of the base
  weights (`asyncrl.weights.lora.AdapterMerger`).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Literal

import torch
from transformers import PreTrainedModel

from asyncrl.config.learner import LoraConfig
from asyncrl.weights.group import join_sync_group
from asyncrl.weights.layout import specs_of, weights_checksum
from asyncrl.weights.lora import AdapterMerger, adapter_specs
from asyncrl.weights.probe import DeliveryProbe
from asyncrl.weights.receiver import WeightReceiver
from rollout_servers.engines.base import (
    AppliedVersion,
    DeliveryError,
    Engine,
    SyncTarget,
    check_delivery,
)


@dataclass
class _Incoming:
    """A received version on its way into the model, applied by whichever thread gets there
    first: the sampling loop (inflight: between decode steps; drain: once no row is live), or
    the weight receiver while no loop runs."""

    weights: list[tuple[str, torch.Tensor]]
    version: int
    probe: DeliveryProbe | None
    subset: bool
    adapters_checksum: str | None
    applied: bool = False
    seconds: float = 0.0
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)


class HFVersionGate(Engine):
    """A transformers model's weights behind a version gate (module docstring). The sampling
    loop of the subclass holds `_lock` while rows are live and asks, between steps, for a
    waiting version (`_between_steps`, `_maybe_apply_waiting`, `_version_waiting`)."""

    def _init_gate(
        self,
        model: PreTrainedModel,
        device: torch.device,
        version: int,
        lora: LoraConfig | None,
        weight_update_mode: Literal["drain", "inflight"],
    ) -> None:
        self.model = model
        self.device = device
        self.weight_update_mode = weight_update_mode
        self._incoming: _Incoming | None = None  # a version the sampling loop may take
        # held by the sampling loop while it runs, and by whoever applies a version from its
        # copy through its delivery check (re-entrant: update_weights and probe_logprobs take
        # it again inside)
        self._lock = threading.RLock()
        self._broken: DeliveryError | None = None
        self._version = version
        self._params = dict(model.state_dict())
        # LoRA (`asyncrl.weights.lora`): versions carry adapters, merged into a copy of the base weights
        self._lora = lora if lora is not None and lora.rank else None
        self._merger = AdapterMerger.of_model(model, self._lora) if self._lora else None
        self._adapters_checksum: str | None = None

    @property
    def version(self) -> int:
        return self._version

    # ---- the sampling loop's side ------------------------------------------------------------
    def _version_waiting(self) -> bool:
        incoming = self._incoming
        return incoming is not None and not incoming.applied

    def _between_steps(self) -> int | None:
        """Sampling loop, between decode steps (holding the lock): inflight mode takes a
        received version and returns it (else None); drain mode leaves it for the loop to apply
        once no row is live."""
        if self.weight_update_mode == "drain":
            return None
        return self._take_incoming()

    def _maybe_apply_waiting(self) -> None:
        """Sampling loop, no row live (holding the lock): apply a waiting version before
        admitting (a failed delivery check is kept in `_broken` and fails later requests)."""
        with contextlib.suppress(DeliveryError):
            self._take_incoming()

    def _take_incoming(self) -> int | None:
        incoming = self._incoming
        if incoming is None or incoming.applied:
            return None
        try:
            self._apply(incoming)
        except DeliveryError:
            raise  # the weights are not the version's: the rows fail, nothing is sampled
        except Exception:  # update_weights refused it before copying anything: the old weights
            return None  # sample on; the receiver raises the error and the server stops
        return incoming.version

    # ---- the weight receiver's side ----------------------------------------------------------
    def follow_learner(self, target: SyncTarget) -> Iterator[AppliedVersion]:
        group = join_sync_group(
            target.host,
            target.port,
            target.rank,
            target.world_size,
            target.device,
            target.timeout_s,
            target.server_id,
            target.epoch,
            target.transport,
            target.key,
        )
        specs = specs_of(self.named_weights())
        if self._lora is not None:
            specs = adapter_specs(self.model, self._lora, self.model.dtype)
        receiver = WeightReceiver(group, specs)
        while (got := receiver.receive()) is not None:
            start = time.perf_counter()
            weights, checksum = got.weights, None
            if self._merger is not None:
                weights = self._merger.merged(got.weights)
                checksum = weights_checksum(got.weights)
            incoming = _Incoming(
                weights, got.version, got.probe, self._merger is not None, checksum
            )
            self._hand_over(incoming)
            got.release()  # copied into the model: the next version may reuse the staging
            if incoming.error is not None:
                raise incoming.error
            # inflight: generation paused only for the copy and check; drain: also the wait
            held = time.perf_counter() - start
            if self.weight_update_mode == "inflight":
                held = incoming.seconds
            yield AppliedVersion(got.version, held)

    def _hand_over(self, incoming: _Incoming) -> None:
        """The sampling loop takes the version (inflight: between two decode steps; drain: once
        its live rows finished, admitting none meanwhile); with no loop running, apply it here.
        Returns once applied, so the next version can be received while the rows go on."""
        self._incoming = incoming
        try:
            while not incoming.done.wait(0.01):
                if self._lock.acquire(blocking=False):  # no sampling loop running
                    try:
                        if not incoming.applied:
                            self._apply(incoming)
                    finally:
                        self._lock.release()
        finally:
            self._incoming = None

    def _apply(self, incoming: _Incoming) -> None:
        """Copy a version into the model and check its delivery (the caller holds the lock, so
        no token is sampled between the two); weights failing the check fail every later
        request."""
        incoming.applied = True
        start = time.perf_counter()
        try:
            self.update_weights(incoming.weights, incoming.version, subset=incoming.subset)
            if incoming.adapters_checksum is not None:
                self._adapters_checksum = incoming.adapters_checksum
            try:
                check_delivery(self, incoming.version, incoming.probe, self.model.config.vocab_size)
            except DeliveryError:
                raise
            except Exception as e:  # copied but unchecked: as bad as a failed check
                raise DeliveryError(
                    f"version {incoming.version} was applied but its delivery check failed: {e!r}"
                ) from e
        except DeliveryError as e:
            self._broken = e
            incoming.error = e
            raise
        except Exception as e:
            incoming.error = e
            raise
        finally:
            incoming.seconds = time.perf_counter() - start
            incoming.done.set()

    # ---- the weights -------------------------------------------------------------------------
    def probe_logprobs(self, ids: list[int]) -> torch.Tensor:
        """See `Engine.probe_logprobs`: one forward of the model that samples, under the lock."""
        x = torch.tensor([ids], device=self.device)
        with self._lock, torch.no_grad():
            logits = self.model(input_ids=x).logits[0, :-1].float()
        return torch.log_softmax(logits, -1).gather(-1, x[0, 1:, None]).squeeze(-1)

    def weights_checksum(self) -> str | None:
        """With LoRA, of the adapters last merged (what the learner sent), None before any."""
        if self._lora is not None:
            return self._adapters_checksum
        return weights_checksum(self.named_weights())

    def update_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], version: int, subset: bool = False
    ) -> None:
        """Apply a whole weight version (thread-safe); raises ValueError and applies nothing
        when a name, shape or dtype does not match the model. A copy that fails after those
        checks may leave some tensors changed: DeliveryError, and every later request fails
        with it. `subset`: the weights not given stay as they are (LoRA: only the adapted layers
        change)."""
        staged = list(weights)
        seen: set[str] = set()
        for name, tensor in staged:
            target = self._params.get(name)
            if target is None:
                raise ValueError(f"update_weights: unknown parameter {name!r}")
            if name in seen:
                raise ValueError(f"update_weights: parameter {name!r} given twice")
            if tensor.shape != target.shape or tensor.dtype != target.dtype:
                raise ValueError(
                    f"update_weights: parameter {name!r} is {tuple(tensor.shape)} {tensor.dtype}, "
                    f"the model has {tuple(target.shape)} {target.dtype}"
                )
            seen.add(name)
        missing = [n for n in self._params if n not in seen]
        if missing and not subset:
            raise ValueError(
                f"update_weights: missing parameter {missing[0]!r} (and {len(missing) - 1} more)"
            )
        with self._lock, torch.no_grad():
            for name, tensor in staged:
                try:
                    self._params[name].copy_(tensor)
                except Exception as e:  # checked above, so unexpected (a device fault)
                    self._broken = DeliveryError(
                        f"version {version} was applied only in part (copying {name!r} failed: "
                        f"{e!r}); the weights are neither version, so this engine samples no more"
                    )
                    raise self._broken from e
            self._version = version

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Live views of the weights; call from the thread that calls `update_weights` (the
        weight receiver) once it applied its version: the writers (receiver, or the sampler
        in inflight mode) hold the lock."""
        yield from self._params.items()
