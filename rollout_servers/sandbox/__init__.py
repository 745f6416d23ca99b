"""Sandbox for model-written Python: run untrusted code, report how it ended apart from its output.

Modules: `runner` (`Sandbox`: slots, one run from spawn to reaped), `backends` (which backend,
checked once with a probe run, and one run's command line), `shared` (`SharedSandbox`, a
server's one instance), `config` (`SandboxResult`; the limits are
`asyncrl.config.sandbox.SandboxConfig`), `prelude` (the trusted code that starts every run
inside the sandbox), `host` (command lines, directories, uids and the sweeping of leftover
processes), `cgroup` (whole-run limits), `seccomp` (the system-call filter), `output` (bounded
capture and the status of a run).

Components:
- `SandboxConfig`: the limits and which isolation backend to use.
- `Sandbox`: checks the configured backend at construction (no fallback: a missing one fails
  with its install command; a weaker one named in the config is logged loudly) and runs
  programs with `run` on the caller's event loop, at most `max_concurrent` at once, each in a
  fresh sandbox with fresh cgroups.
- backends, strongest first (docs/sandbox.md says what each isolates): `bwrap` (bubblewrap: own
  PID/network/IPC/UTS/mount namespaces, a read-only view of the system and the interpreter, a
  private size-bounded tmpfs), `unshare` (util-linux: own PID/network/IPC/UTS/mount namespaces,
  but the host filesystem stays readable), `process` (rlimits and a private directory: NOT a
  security boundary).
- `_PRELUDE`: trusted Python that runs inside the sandbox first (joins the run's cgroups, mounts
  for `unshare`, a supervisor, the drop to the sandbox uid, the seccomp filter, rlimits), then
  runs the code in the same interpreter.

Invariants:
1. Nothing the code started is alive when `run` returns or is cancelled. Under bwrap/unshare the
   process we spawn exits only after the namespace's first process, which the kernel reaps only
   once the namespace is empty (`_reap`); code still running at the end is SIGKILLed first, by
   sweeping its uid (root) or through the namespace's first process (`_kill_running`). Under
   `process` the group, the slot's uid and the run's token are swept (`_kill_stragglers`).
2. The server holds at most `output_limit_bytes` of each stream: pipes are read as they fill and
   the excess is only counted; past `output_kill_bytes` in all the code is killed.
3. The code gets an empty environment (none of the server's secrets) and, under `bwrap` and
   `unshare`, sees no process and no network interface of the host.
4. Limits bind the whole run: its memory, tasks and CPU time are counted by cgroups made for it
   (a watchdog and per-process rlimits where the server cannot make cgroups). As root the code
   never runs as uid 0: each slot owns a uid claimed with a lock file (removed by `close`), so
   RLIMIT_NPROC also counts exactly one sandbox.
5. Nothing passes from one run to the next: fresh tmpfs, IPC and network namespaces each run,
   and keyrings (per uid, not per namespace) denied by the seccomp filter.
"""

from asyncrl.config.sandbox import Backend, SandboxConfig
from rollout_servers.sandbox.config import SandboxResult
from rollout_servers.sandbox.runner import Sandbox
from rollout_servers.sandbox.shared import SharedSandbox

__all__ = ["Backend", "Sandbox", "SandboxConfig", "SandboxResult", "SharedSandbox"]
