"""The reward-model fleet's messages (`reward_models/`), one typed schema each.

    rollout server -> reward-model server   ScoreRequest -> Scores   (a batch of responses)
    client         -> reward-model server   ScoreRequest -> Scores   (benchmarks, `asyncrl eval`)
    reward-model server -> anyone           Error                    (could not decode or sign)

A request carries the items a rollout server finished in one turn of its event loop; the reply
echoes its `request_id` and scores every item in order. Scoring is a pure function of an item,
so a request resent to a restarted server is scored again, never twice into a trajectory: the
sender takes the first reply to each request id and drops any later one.
"""

from __future__ import annotations

import math

from asyncrl.wire.bounds import check_id, check_index
from asyncrl.wire.codec import check, message, struct
from asyncrl.wire.protocol import ChatMessage

MAX_SCORE_ITEMS = 1024  # items in one ScoreRequest
MAX_SCORE_TEXT_CHARS = 1_000_000  # characters of one item (its messages and response together)
MAX_SCORE_ERROR_CHARS = 500  # characters of one item's error


@struct
class ScoreItem:
    messages: list[ChatMessage]  # the prompt, as the policy saw it (chat messages)
    response: str  # the response to score (the text the reward function would be given)
    data_source: str = ""  # the row's data_source (a judge's template may use it)
    ground_truth: str = ""  # the row's reward_model.ground_truth (a judge's template may use it)

    def validate(self) -> None:
        chars = len(self.response) + len(self.ground_truth)
        chars += sum(len(m.content) + len(m.role) for m in self.messages)
        check(
            chars <= MAX_SCORE_TEXT_CHARS, f"ScoreItem: {chars} characters > {MAX_SCORE_TEXT_CHARS}"
        )
        check_id(self.data_source, "ScoreItem.data_source", empty_ok=True)


@message("score_request")
class ScoreRequest:
    request_id: int  # echoed in the reply; unique per sender
    items: list[ScoreItem]  # at least one, at most MAX_SCORE_ITEMS

    def validate(self) -> None:
        check_index(self.request_id, "request_id")
        check(0 < len(self.items) <= MAX_SCORE_ITEMS, f"ScoreRequest: {len(self.items)} items")
        for item in self.items:
            item.validate()


@message("scores")
class Scores:
    request_id: int  # the ScoreRequest answered
    scores: list[float]  # one per item, in order; 0.0 where `errors` names why it has none
    errors: list[str]  # one per item: "" when scored, else why not (a judge's unparsable text)

    def validate(self) -> None:
        check_index(self.request_id, "request_id")
        check(len(self.scores) == len(self.errors), "Scores: scores and errors differ in length")
        check(len(self.scores) <= MAX_SCORE_ITEMS, f"Scores: {len(self.scores)} items")
        for s in self.scores:
            check(math.isfinite(s), f"Scores: a score of {s}")
        for e in self.errors:
            check(len(e) <= MAX_SCORE_ERROR_CHARS, "Scores: an error over 500 characters")
