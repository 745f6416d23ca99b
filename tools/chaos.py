"""Chaos test of a whole run: kill and freeze its processes, then audit what it trained.

    python tools/chaos.py [--minutes N] [--every T] [--stop-s S] [--kinds kill,stop]
        [--no-learner-kill] [--no-replay-kill] [--backend local|ray] [--clean] [--seed K]
        [--startup-s S0] [--settle-s S1] [CONFIG] [section.key=value ...]

Runs `asyncrl launch` on any config (the embedded default when none is given; overrides are
passed through) for N minutes from its first learner step (start-up, a warm-start included, is
not counted; --startup-s bounds it). From the first learner step on, every T seconds it picks a live
rollout server at random and SIGKILLs it or SIGSTOPs it for S seconds (then SIGCONT, if it is
still the same process), or SIGKILLs a reward-model server (`rmkill`, for a run with
`reward.model.path`), the kinds taken in turn from --kinds; once, at a third of the training
window, it SIGKILLs learner rank 0, and once, at two thirds, the replay. Every fault (time, kind,
target, pid) goes to run_dir/chaos.jsonl and is printed.

Processes are found by their environment, as the launchers set it for every fleet process
(`asyncrl.launch.fleet.process_env`): ASYNCRL_RUN_DIR=<run dir> and ASYNCRL_PROCESS=<replay |
server_<i> | reward_model_<i> | learner_<r>>, read from /proc/<pid>/environ. Ray actors are
processes on this machine with the same variables. A process's children (reward workers) inherit them; the target
is the one whose parent is not of the same name.

Length: total_steps is set very large (unless given) and the run is stopped after N minutes:
a fixed wall-clock window is what the clean run can be compared with, whatever the faults cost,
and sizing total_steps would need the throughput under faults in advance. At the deadline the
faults stop, frozen servers are continued, and the tool waits (--settle-s) for the next complete
checkpoint, so the audit's exact accounting (every checkpoint) reaches the end of the run; then
it sends the launcher SIGTERM, which stops the fleets in order (the replay writes its stats).

Unless given, the run gets the settings chaos needs: trainer.log_samples and
learner.weight_checksum on (the audit's records), trainer.save_every=20 with every checkpoint
kept (trainer.keep_checkpoints=0: the audit reads them all), trainer.auto_resume=100 and
launch.max_restarts=100 (so learner, replay and server deaths are survived).

Then it audits the run from its own records (`asyncrl.analysis.audit`), prints the table, writes
run_dir/audit.json, and exits 1 when an invariant fails, the run ended before its window did,
or the learner trained nothing after the last learner or replay kill; with a reward-model fleet,
also when a killed reward-model server was not restarted or a rollout server's responses were
not each settled once (`reward_models`).
`--clean` first runs the same config for the same minutes without faults, audits it too, and
prints the chaos run's throughput as a fraction of the clean run's.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from asyncrl.analysis.audit import Audit, Check, audit_run
from asyncrl.checkpoints import latest_checkpoint
from asyncrl.metrics import read_jsonl

CHAOS_DEFAULTS = {
    "trainer.total_steps": "1000000",
    "trainer.log_samples": "true",
    "learner.weight_checksum": "true",
    "trainer.save_every": "20",
    "trainer.auto_resume": "100",
    "launch.max_restarts": "100",
    "trainer.save_final": "false",
    "trainer.keep_checkpoints": "0",
}
"""What a chaos run is launched with unless its overrides say otherwise."""


# ---- finding the run's processes ------------------------------------------------------------------
def _proc_env(pid: str) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:  # gone, a zombie, or not ours
        return {}
    pairs = (item.partition(b"=") for item in raw.split(b"\0") if item.startswith(b"ASYNCRL_"))
    return {k.decode(): v.decode(errors="replace") for k, _, v in pairs}


def _parent_and_start(pid: str) -> tuple[int, int]:
    """The parent pid and start time (clock ticks since boot) from /proc/<pid>/stat."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[1]), int(fields[19])


@dataclass(frozen=True)
class Member:
    """One fleet process: its name in the run, its pid and its start time (so a signal is never
    sent to a later process that got the same pid)."""

    name: str
    pid: int
    start: int


def fleet_members(run_dir: str | Path) -> dict[str, Member]:
    """The run's fleet processes by name (the newest when a restart left two)."""
    want = os.path.realpath(run_dir)
    found: dict[int, tuple[str, int, int]] = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        env = _proc_env(entry)
        name = env.get("ASYNCRL_PROCESS")
        if name and os.path.realpath(env.get("ASYNCRL_RUN_DIR", "")) == want:
            try:
                found[int(entry)] = (name, *_parent_and_start(entry))
            except (OSError, IndexError):
                continue
    members: dict[str, Member] = {}
    for pid, (name, parent, start) in found.items():
        if found.get(parent, ("",))[0] == name:  # a child of the member (a reward worker)
            continue
        if name not in members or start > members[name].start:
            members[name] = Member(name, pid, start)
    return members


def still_same(m: Member) -> bool:
    try:
        return _parent_and_start(str(m.pid))[1] == m.start
    except (OSError, IndexError):
        return False


# ---- injecting faults -----------------------------------------------------------------------------
@dataclass
class Injector:
    """Sends the faults and logs each one to run_dir/chaos.jsonl and stdout."""

    run_dir: Path
    t0: float
    stop_s: float
    rng: random.Random
    frozen: list[tuple[float, Member]] = field(default_factory=list)
    log: list[dict[str, Any]] = field(default_factory=list)

    def record(self, kind: str, m: Member, note: str = "") -> None:
        entry = {"time": time.time(), "t": round(time.monotonic() - self.t0, 2), "kind": kind}
        entry |= {"target": m.name, "pid": m.pid} | ({"note": note} if note else {})
        self.log.append(entry)
        with (self.run_dir / "chaos.jsonl").open("a") as f:
            f.write(json.dumps(entry) + "\n")
        print(f"chaos: t={entry['t']:7.1f}s {kind:<7} {m.name} pid {m.pid} {note}", flush=True)

    def signal(self, kind: str, m: Member, sig: signal.Signals, note: str = "") -> bool:
        if not still_same(m):
            return False
        try:
            os.kill(m.pid, sig)
        except ProcessLookupError:
            return False
        self.record(kind, m, note)
        return True

    def kill(self, name: str) -> None:
        m = fleet_members(self.run_dir).get(name)
        if m is None or not self.signal("sigkill", m, signal.SIGKILL):
            print(f"chaos: no live {name} to kill", flush=True)

    def server_fault(self, kind: str) -> None:
        frozen = {m.pid for _, m in self.frozen}
        prefix = "reward_model_" if kind == "rmkill" else "server_"
        servers = [m for n, m in fleet_members(self.run_dir).items() if n.startswith(prefix)]
        if kind == "stop":  # freeze one that is not frozen already
            servers = [m for m in servers if m.pid not in frozen]
        if not servers:
            print(f"chaos: no server to {kind}", flush=True)
            return
        m = self.rng.choice(sorted(servers, key=lambda s: s.name))
        if kind in ("kill", "rmkill"):
            self.signal("sigkill", m, signal.SIGKILL)
        elif self.signal("sigstop", m, signal.SIGSTOP, f"for {self.stop_s:g}s"):
            self.frozen.append((time.monotonic() + self.stop_s, m))

    def thaw(self, now: float = float("inf")) -> None:
        """SIGCONT every frozen server whose time is up (all of them by default)."""
        due = [(t, m) for t, m in self.frozen if t <= now]
        self.frozen = [(t, m) for t, m in self.frozen if t > now]
        for _, m in due:
            self.signal("sigcont", m, signal.SIGCONT)


@dataclass
class Plan:
    """When each fault is due, in seconds from the first learner step."""

    window_s: float
    every_s: float
    kinds: list[str]
    learner_kill: bool
    replay_kill: bool

    def events(self) -> list[tuple[float, str]]:
        out = []
        if self.every_s > 0 and self.kinds:
            k = 1
            while k * self.every_s < self.window_s:
                out.append((k * self.every_s, self.kinds[(k - 1) % len(self.kinds)]))
                k += 1
        if self.learner_kill:
            out.append((self.window_s / 3, "learner"))
        if self.replay_kill:
            out.append((2 * self.window_s / 3, "replay"))
        return sorted(out)


# ---- one run ----------------------------------------------------------------------------------------
def launch_command(args: argparse.Namespace, run_dir: Path) -> list[str]:
    given = {o.split("=", 1)[0] for o in args.overrides if "=" in o}
    extra = [f"{k}={v}" for k, v in CHAOS_DEFAULTS.items() if k not in given]
    if "launch.backend" not in given:
        extra.append(f"launch.backend={args.backend}")
    extra.append(f"trainer.run_dir={run_dir}")
    return [sys.executable, "-m", "asyncrl.launch.cli", "launch", *args.overrides, *extra]


def _wait_first_step(proc: subprocess.Popen, run_dir: Path, deadline: float) -> bool:
    while not read_jsonl(run_dir / "metrics.jsonl"):
        if proc.poll() is not None or time.monotonic() > deadline:
            return False
        time.sleep(0.5)
    return True


def _settle(proc: subprocess.Popen, run_dir: Path, timeout_s: float) -> None:
    """Until a checkpoint newer than the steps done now is complete (or the timeout)."""
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text()) or {}
    if not cfg.get("trainer", {}).get("save_every"):
        return
    steps = len(read_jsonl(run_dir / "metrics.jsonl"))
    deadline = time.monotonic() + timeout_s
    while proc.poll() is None and time.monotonic() < deadline:
        ckpt = latest_checkpoint(run_dir)
        if ckpt is not None and int(ckpt.name.removeprefix("step_")) >= steps:
            return
        time.sleep(0.5)


def _stop(proc: subprocess.Popen) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.wait()


def _inject(proc: subprocess.Popen, injector: Injector, plan: Plan) -> None:
    """The faults of `plan`, each when due, until the window ends or the launcher does."""
    events = plan.events()
    deadline = injector.t0 + plan.window_s
    while proc.poll() is None and time.monotonic() < deadline:
        now = time.monotonic()
        injector.thaw(now)
        while events and injector.t0 + events[0][0] <= now:
            _, what = events.pop(0)
            if what in ("kill", "stop", "rmkill"):
                injector.server_fault(what)
            else:
                injector.kill("learner_0" if what == "learner" else "replay")
        time.sleep(0.2)
    while injector.frozen and proc.poll() is None:  # a freeze lasts its whole stop_s
        injector.thaw(time.monotonic())
        time.sleep(0.2)
    injector.thaw()  # the launcher ended: nothing left to hold frozen


def run_once(args: argparse.Namespace, run_dir: Path, faults: bool) -> dict[str, Any]:
    """Launch, wait for the first learner step, inject faults (when `faults`) for the window,
    let a last checkpoint complete, stop; what happened (`ended_early`: why the run did not
    last its window, "" when it did)."""
    start, window_s = time.monotonic(), args.minutes * 60
    cmd = launch_command(args, run_dir)
    print(f"chaos: {'chaos' if faults else 'clean'} run: {' '.join(cmd[2:])}", flush=True)
    proc = subprocess.Popen(cmd, start_new_session=True)
    injector = Injector(run_dir, 0.0, args.stop_s, random.Random(args.seed))
    ended_early = f"no learner step within {args.startup_s:g}s"
    if _wait_first_step(proc, run_dir, start + args.startup_s):
        injector.t0 = time.monotonic()
        plan = Plan(window_s, args.every, args.kinds, *args.big_kills)
        _inject(proc, injector, plan if faults else Plan(window_s, 0, [], False, False))
        lasted, rc = time.monotonic() - injector.t0, proc.poll()
        ended_early = f"the run ended after {lasted:.0f}s of {window_s:g}s" if rc else ""
        if rc is None:  # still going (rc 0: it reached its total_steps)
            _settle(proc, run_dir, args.settle_s)
    stopped_at = time.time()  # when the launcher is told to stop (it restarts nothing after)
    rc = _stop(proc)
    if ended_early:
        ended_early += f" (launcher exit code {rc})"
    return {
        "launcher_rc": rc,
        "ended_early": ended_early,
        "wall_s": round(time.monotonic() - start, 1),
        "stopped_at": stopped_at,
        "faults": injector.log,
    }


# ---- the report -------------------------------------------------------------------------------------
def recovered(run_dir: Path, faults: list[dict[str, Any]]) -> Check:
    """Whether the learner trained a step after the last learner or replay kill (a resumed run
    that never got going again is no success, even if its records are consistent)."""
    kills = [
        f
        for f in faults
        if f["kind"] == "sigkill" and not f["target"].startswith(("server", "reward_model"))
    ]
    if not kills:
        return Check("recovered", True, "no learner or replay kill")
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    after = [m for m in metrics if m["time"] > kills[-1]["time"]]
    detail = f"{len(after)} step(s) after the {kills[-1]['target']} kill at t={kills[-1]['t']}s"
    return Check("recovered", bool(after), detail)


def reward_models_held(run_dir: Path, outcome: dict[str, Any]) -> Check | None:
    """With a reward-model fleet: every killed reward-model server was restarted (unless the
    run stopped before its restart was due: `launch.restart_backoff_s`, doubled per restart of
    that server), and every response a rollout server sent the fleet was settled once (scored,
    or 0.0 on a counted timeout or at shutdown). None for a run without a fleet."""
    kills = [
        f
        for f in outcome["faults"]
        if f["kind"] == "sigkill" and f["target"].startswith("reward_model_")
    ]
    restarts = [
        r
        for r in read_jsonl(run_dir / "restarts.jsonl")
        if r["server"].startswith("reward_model_") and r["event"] == "restart"
    ]
    stats = [json.loads(p.read_text()) for p in (run_dir / "stats").glob("server_*.json")]
    sent = [s for s in stats if "reward_model_items" in s]
    if not kills and not sent:
        return None
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text()) or {}
    backoff_s = cfg.get("launch", {}).get("restart_backoff_s", 2.0)
    missed = []
    for kill in kills:
        before = [r for r in restarts if r["server"] == kill["target"] and r["time"] < kill["time"]]
        after = [r for r in restarts if r["server"] == kill["target"] and r["time"] > kill["time"]]
        due = kill["time"] + min(300.0, backoff_s * 2 ** len(before))
        if not after and due + 1.0 < outcome["stopped_at"]:  # 1 s: the launcher's loop
            missed.append(f"{kill['target']} at t={kill['t']}s")
    uneven = [s for s in sent if s["reward_model_items"] != s.get("reward_model_settled")]
    timeouts = sum(s.get("reward_model_timeout", 0) for s in sent)
    detail = (
        f"{len(kills)} killed, {len(restarts)} restarted"
        + (f" (not restarted: {', '.join(missed)})" if missed else "")
        + f"; {len(sent)} server(s) sent {sum(s['reward_model_items'] for s in sent):.0f} "
        f"responses, {len(uneven)} with unsettled ones, {timeouts:.0f} scored 0 on a timeout"
    )
    return Check("reward_models", not missed and not uneven, detail)


def report(run_dir: Path, outcome: dict[str, Any], clean: Audit | None) -> bool:
    """Audit the run, print the table, write run_dir/audit.json; whether everything held."""
    audit = audit_run(run_dir)
    kinds: dict[str, int] = {}
    for f in outcome["faults"]:
        kinds[f["kind"]] = kinds.get(f["kind"], 0) + 1
    audit.counts |= {f"faults_{k}": v for k, v in sorted(kinds.items())}
    audit.counts["launcher_rc"] = outcome["launcher_rc"]
    audit.checks.insert(0, Check("survived", not outcome["ended_early"], outcome["ended_early"]))
    audit.checks.insert(1, recovered(run_dir, outcome["faults"]))
    if (held := reward_models_held(run_dir, outcome)) is not None:
        audit.checks.insert(2, held)
    doc = audit.to_json() | {"outcome": outcome}
    if clean is not None:
        chaos_rate = audit.counts.get("samples_per_s", 0.0)
        clean_rate = clean.counts.get("samples_per_s", 0.0)
        ratio = chaos_rate / clean_rate if clean_rate else 0.0
        audit.counts["clean_samples_per_s"] = clean_rate
        audit.counts["throughput_vs_clean"] = ratio
        doc = audit.to_json() | {"outcome": outcome, "clean": clean.to_json()}
    (run_dir / "audit.json").write_text(json.dumps(doc, indent=1))
    if clean is not None:
        print(clean.table())
    print(audit.table())
    return audit.ok and (clean is None or clean.ok)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=10.0, help="from the first step on")
    p.add_argument("--every", type=float, default=60.0, help="seconds between server faults")
    p.add_argument("--stop-s", type=float, default=60.0, help="how long a SIGSTOP lasts")
    p.add_argument(
        "--kinds",
        default="kill,stop",
        help="faults taken in turn: kill, stop (a rollout server), rmkill (a reward-model server)",
    )
    p.add_argument("--no-learner-kill", action="store_true")
    p.add_argument("--no-replay-kill", action="store_true")
    p.add_argument("--backend", choices=("local", "ray"), default="local")
    p.add_argument("--clean", action="store_true", help="a clean run of the same length first")
    p.add_argument("--startup-s", type=float, default=900.0, help="wait for a first step")
    p.add_argument("--settle-s", type=float, default=120.0, help="wait for a last checkpoint")
    p.add_argument("--seed", type=int, default=0, help="seeds the choice of servers")
    p.add_argument("overrides", nargs="*", help="[CONFIG] section.key=value ...")
    args = p.parse_args(argv)
    args.kinds = [k for k in args.kinds.split(",") if k]
    if bad := [k for k in args.kinds if k not in ("kill", "stop", "rmkill")]:
        p.error(f"--kinds: {bad} (kill, stop, rmkill)")
    args.big_kills = (not args.no_learner_kill, not args.no_replay_kill)
    return args


def chaos_run_dir(overrides: list[str]) -> Path:
    given = [o.split("=", 1)[1] for o in overrides if o.startswith("trainer.run_dir=")]
    run_dir = given[-1] if given else "runs/chaos-{time}"
    return Path(run_dir.replace("{time}", time.strftime("%Y%m%d-%H%M%S"))).resolve()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    run_dir = chaos_run_dir(args.overrides)
    args.overrides = [o for o in args.overrides if not o.startswith("trainer.run_dir=")]
    clean = None
    if args.clean:
        clean_dir = run_dir.with_name(run_dir.name + "-clean")
        run_once(args, clean_dir, faults=False)
        clean = audit_run(clean_dir)
    outcome = run_once(args, run_dir, faults=True)
    return 0 if report(run_dir, outcome, clean) else 1


if __name__ == "__main__":
    sys.exit(main())
