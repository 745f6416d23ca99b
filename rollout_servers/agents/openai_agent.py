"""The `openai` agent loop: runs a user's agent, written against the OpenAI client, unchanged,
and trains on exactly the tokens the engine sampled for it (docs/agents.md).

`rollout.openai.agent` names `package.module:function`. Per episode (one sample of one row)
the loop opens an episode on the server's `OpenAIEndpoint` (started on first use, on the
server's event loop) and calls the function with a client bound to the episode's base URL and
key, and the row (a plain dict, below):
- `async def fn(client: openai.AsyncOpenAI, row)` runs as a task on the server's loop;
- a plain `def fn(client: openai.OpenAI, row)` runs in a thread, so a blocking agent cannot
  stall the loop. A thread cannot be cancelled: one that overruns `timeout_s` runs on until it
  returns, but its episode is closed, so its later requests are refused (401).
Clients are made with `max_retries=0`: a 4xx of the endpoint is a fact about the request. Their
timeouts (connect included) are the episode's `timeout_s`: the endpoint shares the server's event
loop with every episode, and a loop busy for a few seconds (hundreds of episodes on a loaded
CPU) would otherwise fail connects at the client's default 5 s, and with them the episodes.
It also gets `rollout.openai.agent_kwargs` as keyword arguments. It returns the final
messages (the server's reward function then scores the trajectory's last reply, as for every
loop), a float (that is the reward), or a dict with `messages` or `reward` and optionally
`metrics` ({name: number}, recorded on the trajectory as `agent_<name>`). An exception, a
timeout or another return value is counted (`openai_agent_errors`, `openai_agent_timeouts`)
and scores 0; the server goes on.

The trajectory is the chain of completions that ends in the episode's final one (the one the
returned messages continue, else the last one recorded): the first completion's prompt ids,
then per completion the template ids of the messages appended (loss mask 0) and its sampled ids
(mask 1, the engine's log-probs and versions). Each completion's prompt begins with the one
before it, ids and all, as in the tool agent.

Drift policy: **refuse**. A request that continues none of the episode's completions (the
client rewrote, re-ordered or dropped earlier turns, or started a second conversation) is still
served, so the agent runs on, but it is counted (`openai_drift`) and the episode is refused for
training: its trajectory keeps its ids and reward but has loss mask 0 everywhere, so nothing in
it reaches the loss. Splitting would train on segments whose context the model never saw whole.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections import Counter
from collections.abc import Callable
from typing import Any

from asyncrl.config.rollout import OpenAIConfig
from asyncrl.registry import import_object
from asyncrl.wire.protocol import PromptItem
from rollout_servers.agents.base import AgentResult
from rollout_servers.agents.openai_continuation import Completion
from rollout_servers.agents.openai_endpoint import Episode, OpenAIEndpoint
from rollout_servers.agents.openai_protocol import RequestError, message_key, parse_chat_request
from rollout_servers.engines.base import Engine, SamplingParams

log = logging.getLogger("asyncrl.openai_agent")

METRIC_KEYS = (
    "openai_requests",  # requests the episode's key made (refused ones included)
    "openai_completions",  # completions recorded
    "openai_unused_completions",  # recorded but not on the trajectory's chain (other choices)
    "openai_drift",  # requests that continued none of the earlier completions
    "openai_refused",  # 1 when drift refused the episode (loss mask all 0)
    "openai_agent_errors",  # the function raised or returned something else
    "openai_agent_timeouts",  # the function ran past rollout.openai.timeout_s
)

TOTAL_KEYS = ("episodes", "agent_errors", "agent_timeouts", "drift", "refused")
"""What `OpenAIAgentLoop.stats` sums over episodes (the episode count, then METRIC_KEYS')."""


def load_agent(path: str) -> Callable[..., Any]:
    """The function at `package.module:function` (`asyncrl.registry.import_object`); ValueError
    naming `rollout.openai.agent` when the path does not import or names no function."""
    try:
        fn = import_object(path)
    except ValueError as e:
        raise ValueError(f"rollout.openai.agent={path!r}: {e}") from e
    if not callable(fn):
        raise ValueError(f"rollout.openai.agent={path!r} is not a function")
    return fn


def quiet_http_loggers() -> None:
    """Log the agent clients' HTTP libraries at WARNING: at INFO they write a line per agent
    request into the server's log (about 480 KB a 30-step demo). A level a user has set on
    them is kept."""
    import openai

    names = {"httpx", "httpcore", openai.DefaultAsyncHttpxClient.__mro__[1].__module__}
    for name in {n.partition(".")[0] for n in names}:
        logger = logging.getLogger(name)
        if logger.level == logging.NOTSET:
            logger.setLevel(logging.WARNING)


def agent_row(prompt: PromptItem) -> dict[str, Any]:
    """What the agent function gets of its row: plain data, no asyncrl types."""
    return {
        "messages": [{"role": m.role, "content": m.content} for m in prompt.messages],
        "data_source": prompt.data_source,
        "ground_truth": prompt.ground_truth,
        "extra_info": dict(prompt.extra_info),
        "tools_kwargs": dict(prompt.tools_kwargs),
    }


class OpenAIAgentLoop:
    """The `openai` loop (module docstring). Built with the registry's common keywords plus
    `config` (`rollout.openai`); the server passes it when `rollout.openai.enabled`."""

    def __init__(
        self,
        engine: Engine,
        tokenizer: Any,
        params: SamplingParams,
        config: OpenAIConfig | None = None,
        **_unused: Any,
    ):
        if config is None or not config.enabled:
            raise ValueError("the openai agent loop needs rollout.openai.enabled=true")
        self.engine, self.tokenizer, self.params, self.config = engine, tokenizer, params, config
        self.agent = load_agent(config.agent)
        self.endpoint = OpenAIEndpoint(engine, tokenizer, config)
        quiet_http_loggers()
        self._started: asyncio.Task[str] | None = None
        self.totals: Counter[str] = Counter(dict.fromkeys(TOTAL_KEYS, 0))
        """Episode outcomes summed over the server's life (`stats`)."""

    def stats(self) -> dict[str, float]:
        """The server's running counts: the endpoint's requests and refusals by status
        (`openai_requests`, `openai_status_429`, ...) and the episodes' outcomes
        (`openai_episodes`, `openai_agent_errors`, `openai_drift`, ...)."""
        counts = {**self.endpoint.counters, **self.totals}
        return {f"openai_{k}": float(v) for k, v in sorted(counts.items())}

    async def base_url(self) -> str:
        """The endpoint's base URL, starting it on the first call."""
        if self._started is None:
            self._started = asyncio.ensure_future(self.endpoint.start())
        return await asyncio.shield(self._started)

    async def close(self) -> None:
        """Stop serving (episodes still running get refused)."""
        await self.endpoint.close()

    async def run(self, prompt: PromptItem, params: SamplingParams | None = None) -> AgentResult:
        base_url = await self.base_url()
        episode = self.endpoint.open_episode(params or self.params)
        metrics = dict.fromkeys(METRIC_KEYS, 0.0)
        try:
            returned = await asyncio.wait_for(
                self._call_agent(base_url, episode.key, agent_row(prompt)), self.config.timeout_s
            )
            returned, reward = self._unpack(returned, metrics)
        except asyncio.TimeoutError:
            metrics["openai_agent_timeouts"] = 1.0
            returned, reward = None, 0.0
        except Exception as e:
            log.warning("the openai agent %s failed: %r", self.config.agent, e)
            metrics["openai_agent_errors"] = 1.0
            returned, reward = None, 0.0
        finally:
            self.endpoint.close_episode(episode)
        if reward is None and not isinstance(returned, list):
            metrics["openai_agent_errors"], reward = 1.0, 0.0
        result = self._assemble(prompt, episode, returned, reward, metrics)
        self.totals["episodes"] += 1
        for key in TOTAL_KEYS[1:]:
            self.totals[key] += int(metrics[f"openai_{key}"])
        return result

    async def _call_agent(self, base_url: str, key: str, row: dict[str, Any]) -> Any:
        import openai

        timeout = self.config.timeout_s  # every phase, connect included (module docstring)
        if inspect.iscoroutinefunction(self.agent):
            http = openai.DefaultAsyncHttpxClient(trust_env=False, timeout=timeout)
            client = openai.AsyncOpenAI(
                base_url=base_url, api_key=key, max_retries=0, http_client=http, timeout=timeout
            )
            async with client:
                return await self.agent(client, row, **self.config.agent_kwargs)

        def in_thread() -> Any:
            http = openai.DefaultHttpxClient(trust_env=False, timeout=timeout)
            with openai.OpenAI(
                base_url=base_url, api_key=key, max_retries=0, http_client=http, timeout=timeout
            ) as client:
                return self.agent(client, row, **self.config.agent_kwargs)

        return await asyncio.to_thread(in_thread)

    @staticmethod
    def _unpack(returned: Any, metrics: dict[str, float]) -> tuple[Any, float | None]:
        """(the returned messages or None, the returned reward or None), the agent's own
        metrics added to `metrics`; a dict of another shape is a ValueError (an agent error)."""
        if _is_number(returned):
            return None, float(returned)
        if not isinstance(returned, dict):
            return returned, None
        unknown = set(returned) - {"messages", "reward", "metrics"}
        reward = returned.get("reward")
        extra = returned.get("metrics") or {}
        if unknown:
            raise ValueError(f"the agent returned a dict with unknown keys {sorted(unknown)}")
        if reward is not None and not _is_number(reward):
            raise ValueError(f"the agent returned a reward that is not a number: {reward!r}")
        if not isinstance(extra, dict) or not all(
            isinstance(k, str) and _is_number(v) for k, v in extra.items()
        ):
            raise ValueError("the agent's metrics must map names to numbers")
        metrics.update({f"agent_{k}": float(v) for k, v in extra.items()})
        return returned.get("messages"), None if reward is None else float(reward)

    def _assemble(
        self,
        prompt: PromptItem,
        episode: Episode,
        returned: Any,
        reward: float | None,
        metrics: dict[str, float],
    ) -> AgentResult:
        metrics["openai_requests"] = float(episode.requests)
        metrics["openai_completions"] = float(len(episode.completions))
        metrics["openai_drift"] = float(episode.drift)
        final = self._final_completion(episode, returned)
        if final is None:  # nothing sampled: one template id, nothing to train on
            return self._empty(prompt, reward, metrics)
        chain = [final]
        while chain[-1].continues is not None:
            chain.append(chain[-1].continues)
        chain.reverse()
        metrics["openai_unused_completions"] = float(len(episode.completions) - len(chain))
        result = trajectory_of(chain)
        if episode.drift:
            metrics["openai_refused"] = 1.0
            result.loss_mask = [0] * len(result.loss_mask)
        result.reward, result.metrics = reward, metrics
        return result

    def _final_completion(self, episode: Episode, returned: Any) -> Completion | None:
        """The completion the returned messages continue (their last reply), else the last."""
        if not episode.completions:
            return None
        if isinstance(returned, list) and returned:
            try:
                keys = [message_key(m) for m in _messages_of(returned)]
            except RequestError:
                keys = []
            for c in reversed(episode.completions):
                _, before, reply = c.context
                if keys[: len(before) + 1] == [*before, reply]:
                    return c
        return episode.completions[-1]

    def _empty(
        self, prompt: PromptItem, reward: float | None, metrics: dict[str, float]
    ) -> AgentResult:
        from rollout_servers.agents.turn_renderer import render_ids

        messages = [{"role": m.role, "content": m.content} for m in prompt.messages]
        end = int(self.tokenizer.eos_token_id)
        score = 0.0 if reward is None else reward
        ids = render_ids(self.tokenizer, messages)
        return AgentResult(ids, [end], [0], [0.0], [-1], "", "no_completion", metrics, score)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _messages_of(returned: list[Any]) -> list[dict[str, Any]]:
    """The returned messages read as a request would read them (objects of the openai package,
    pydantic models, become dicts first)."""
    dicts = [m.model_dump() if hasattr(m, "model_dump") else m for m in returned]
    return parse_chat_request({"model": "", "messages": dicts}, "").messages


def trajectory_of(chain: list[Completion]) -> AgentResult:
    """Prompt and response of a chain of completions, each continuing the one before."""
    prompt_ids = chain[0].prompt_ids
    ids: list[int] = []
    mask: list[int] = []
    logprobs: list[float] = []
    versions: list[int] = []
    for c in chain:
        template = c.prompt_ids[len(prompt_ids) + len(ids) :]
        ids += template + c.token_ids
        mask += [0] * len(template) + [1] * len(c.token_ids)
        logprobs += [0.0] * len(template) + c.logprobs
        versions += [-1] * len(template) + c.versions
    last = chain[-1]
    return AgentResult(list(prompt_ids), ids, mask, logprobs, versions, last.text, last.finish)
