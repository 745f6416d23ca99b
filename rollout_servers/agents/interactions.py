"""Interactions: a simulated user that reads the model's answer and replies, turn by turn.

When the model ends a turn without a tool call, the tool agent loop asks the row's interaction
to respond: it may stop the conversation, or reply as the user (feedback, a hint) so the model
tries again; each response carries a turn-level reward. A row selects its interaction with
`interaction_kwargs: {name: ..., ...}`; the other keys go to `start`.

Like tools, one `Interaction` object serves every trajectory of a server and keeps the state
of each under its instance id between `start` and `finish` (which the loop always calls).

An interaction config (`load_interaction_config`) names the instances a server offers:

    interactions:
      - name: gsm8k_retry            # what rows put in interaction_kwargs.name
        class_name: gsm8k_retry      # a registered name, or package.module:ClassName
        config: {}                   # keyword arguments of the class
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, NamedTuple

import yaml

from asyncrl.data.gsm8k import gsm8k_final_answer, same_number
from asyncrl.registry import Registry


class InteractionReply(NamedTuple):
    should_stop: bool
    """True ends the trajectory (the reply is then not shown to the model)."""
    reply: str
    """The user's next message."""
    turn_reward: float
    """Reward of the answer just read (summed into the `interaction_reward` metric)."""
    metrics: dict[str, float]
    """Per-turn numbers, summed per trajectory as `interaction_<key>`."""


class Interaction(ABC):
    """A simulated user for many concurrent trajectories, each under its own instance id."""

    def start(self, instance_id: str, **kwargs: Any) -> None:  # noqa: B027 (optional)
        """Set up one trajectory (the row's interaction_kwargs without `name`)."""

    @abstractmethod
    async def respond(self, instance_id: str, messages: list[dict[str, str]]) -> InteractionReply:
        """Read the conversation so far (its last message is the model's answer) and reply."""

    def finish(self, instance_id: str) -> None:  # noqa: B027 (optional)
        """Drop the state of one trajectory."""


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def final_number(text: str) -> str | None:
    """The answer after the last `#### `, else the last number in `text`, commas dropped."""
    answer = gsm8k_final_answer(text)
    if answer is not None:
        return answer
    numbers = _NUMBER.findall(text)
    return numbers[-1].replace(",", "") if numbers else None


class Gsm8kRetryInteraction(Interaction):
    """Checks the final number of each answer against the ground truth: right stops the
    conversation with turn reward 1, wrong tells the model so and asks it to try again (turn
    reward 0). The ground truth comes from `start(ground_truth=...)`."""

    def __init__(
        self,
        feedback: str = "Your answer is wrong. Think again and give the final answer after ####.",
    ):
        self.feedback = feedback
        self._truths: dict[str, str] = {}

    def start(self, instance_id: str, ground_truth: str = "", **kwargs: Any) -> None:
        self._truths[instance_id] = str(ground_truth)

    async def respond(self, instance_id: str, messages: list[dict[str, str]]) -> InteractionReply:
        answer = final_number(messages[-1]["content"]) if messages else None
        if answer is not None and same_number(answer, self._truths[instance_id]):
            return InteractionReply(True, "", 1.0, {"correct": 1.0})
        return InteractionReply(False, self.feedback, 0.0, {"correct": 0.0})

    def finish(self, instance_id: str) -> None:
        self._truths.pop(instance_id, None)


INTERACTIONS: Registry[type[Interaction]] = Registry("interaction", "asyncrl.interactions")
"""Registered interaction classes (also from the `asyncrl.interactions` entry points)."""
INTERACTIONS.register("gsm8k_retry", "rollout_servers.agents.interactions:Gsm8kRetryInteraction")

register_interaction = INTERACTIONS.register
"""`@register_interaction("my_user")` over an Interaction subclass."""


def setup_interaction(class_name: str, **config: Any) -> Interaction:
    """An instance of the registered (or imported) interaction class `class_name`."""
    cls = INTERACTIONS.resolve(class_name)
    if not (isinstance(cls, type) and issubclass(cls, Interaction)):
        raise ValueError(f"{class_name!r} is not an Interaction subclass")
    return cls(**config)


def load_interaction_config(path: str | Path | None) -> dict[str, Interaction]:
    """The interactions listed in the YAML file at `path` (layout in the module docstring), by
    name; None gives every registered interaction under its own name, default config."""
    if path is None:
        return {name: setup_interaction(name) for name in INTERACTIONS}
    raw = yaml.safe_load(Path(path).read_text()) or {}
    entries = raw.get("interactions") if isinstance(raw, dict) else None
    if not isinstance(entries, list):
        raise ValueError(f"{path}: expected a top-level `interactions:` list")
    out: dict[str, Interaction] = {}
    for i, entry in enumerate(entries):
        where = f"{path}: interactions[{i}]"
        if not isinstance(entry, dict) or set(entry) - {"name", "class_name", "config"}:
            raise ValueError(f"{where}: expected only keys name, class_name, config")
        name = entry.get("name")
        if not isinstance(name, str) or not name or name in out:
            raise ValueError(f"{where}: needs a unique non-empty name, got {name!r}")
        try:
            out[name] = setup_interaction(
                entry.get("class_name", name), **(entry.get("config") or {})
            )
        except (TypeError, ValueError) as e:
            raise ValueError(f"{where}: {e}") from e
    return out
