"""A fuzzer for the replay service: valid messages of every type, mutated, sent to a live replay.

DESIGN.md promises that a malformed message "is rejected and counted, never crashes the
receiver". This package is how that promise is tested (tests/integration/test_fuzz_replay.py, a
few thousand messages) and stressed (`python tools/fuzz_replay.py --messages 100000`).

Components, in the order a campaign uses them:
- `examples`: a valid message of every registered type (the replay's requests meaningful for the
  live replay's state; every other type from its annotations).
- `mutations`: bytes, frames, header fields (any depth, any hostile value), array descriptors.
- `scenarios`: messages that decode but mean harm (uneven samples, evaluation jobs of 10**12
  samples, checkpoints through a regular file, extreme versions and counts, ...).
- `cases`: case `i` of seed `s`: one family of mutation applied to one valid message.
- `process` and `child`: the replay in a process of its own; a crash is written down with the
  message that caused it, and the process ends.
- `clients`: many DEALER identities, a window of unanswered messages, every answer counted;
  `prepare` / `unwrap` hooks for signing what is sent and checking what comes back.
- `auth_hooks`: those hooks for a replay that authenticates every message (`asyncrl.wire.auth`):
  fuzz messages signed with a role allowed to send them, one in ten with a forged signature.
- `checks`: the accounting invariant and a real lease -> samples -> batch round trip.
- `campaign`: the loop that ties them together and the `Report` it returns.

Import it as a package named `replay_fuzz` with `tools/` on the path (tools/fuzz_replay.py does),
or from a file path (the tests do, like tools/simulate.py's tests).
"""

from .campaign import CampaignConfig, Crash, Report, default_replay_config, run_campaign
from .cases import Case, generate_case, writes_outside
from .checks import check_accounting, round_trip
from .clients import identity_hook, reply_name
from .examples import Context, generic_message, valid_message

__all__ = [
    "CampaignConfig",
    "Case",
    "Context",
    "Crash",
    "Report",
    "check_accounting",
    "default_replay_config",
    "generate_case",
    "generic_message",
    "identity_hook",
    "reply_name",
    "round_trip",
    "run_campaign",
    "valid_message",
    "writes_outside",
]
