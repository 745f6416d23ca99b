"""Whether a rollout server's engine still samples, asked after a group failed: the answer
decides whom the failure is blamed on. An engine that answers a one-token request is fine,
so the group's row is reported to the replay (`replay.max_group_failures` then decides the
row's fate); an engine that answers none stops the server, which the launcher restarts,
instead of rows being given up one by one for the engine's fault.
"""

from __future__ import annotations

import asyncio
import dataclasses

from rollout_servers.engines.base import Engine, SamplingParams

PROBES = 3  # one-token requests that must all fail before a failed group stops the server
PROBE_PAUSE_S = 1.0  # between two of them
PROBE_TIMEOUT_S = 120.0  # one probe's wait (a busy engine queues it behind a full batch)


async def probe_engine(
    engine: Engine, greedy: SamplingParams, failed: str, error: Exception
) -> None:
    """Whether `engine` still samples after `failed` (a group) failed with `error`: a
    one-token greedy request (token 0 is in every vocabulary), tried PROBES times a second
    apart (a probe admitted together with the failing prompt can fail with it: a prefill that
    ran out of device memory); RuntimeError when every try fails."""
    params = dataclasses.replace(greedy, max_new_tokens=1)
    for attempt in range(1, PROBES + 1):
        try:
            await asyncio.wait_for(engine.generate([0], params), PROBE_TIMEOUT_S)
            return
        except Exception as probe_error:
            if attempt == PROBES:
                raise RuntimeError(
                    f"the engine failed {PROBES} one-token probes after {failed} failed "
                    f"({type(error).__name__}: {error}): stopping"
                ) from probe_error
            await asyncio.sleep(PROBE_PAUSE_S)
