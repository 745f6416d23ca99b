"""The launcher stops every process when one dies or on Ctrl-C, and leaves no orphans; it names
the first process to die in time (and lists the deaths that followed); a dataset it cannot use
fails before any process starts."""

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pyarrow.parquet as pq
import pytest

from asyncrl.data.prompts import write_rows
from asyncrl.launch.fleet import LaunchError, raise_on_failure
from asyncrl.launch.local import LocalFleet
from asyncrl.run_spec import RunSpec
from asyncrl.wire.auth import new_secret, write_secret

pytestmark = pytest.mark.integration


def _start(
    tmp_path: Path, *overrides: str, sigint_ignored: bool = False
) -> tuple[subprocess.Popen, Path]:
    """A launch past its first learner step; with `sigint_ignored` it starts as a background
    job of a script does: SIGINT ignored (which Python keeps, unless told otherwise)."""
    run_dir = tmp_path / "run"
    argv = [
        sys.executable,
        "-m",
        "asyncrl.launch.cli",
        "launch",
        "trainer.total_steps=100000",
        "trainer.warmstart_steps=10",
        f"trainer.cache_dir={tmp_path / 'cache'}",
        f"trainer.run_dir={run_dir}",
        "launch.progress=line",
        *overrides,
    ]
    ignore = (lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if sigint_ignored else None
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=ignore
    )
    deadline = time.monotonic() + 180
    while not (run_dir / "metrics.jsonl").exists() or not (run_dir / "metrics.jsonl").read_text():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the run did not reach its first learner step"
        time.sleep(0.2)
    return proc, run_dir


def _fleet(launcher_pid: int) -> list[psutil.Process]:
    return psutil.Process(launcher_pid).children(recursive=True)


def _assert_all_gone(procs: list[psutil.Process]) -> None:
    _, alive = psutil.wait_procs(procs, timeout=10)
    assert not alive, f"orphans left: {[p.pid for p in alive]}"


@pytest.mark.long  # over 30 s: its own CI step (the default tier stays under 15 min)
def test_a_dead_server_stops_the_run_and_is_named(tmp_path):
    proc, _ = _start(tmp_path, "launch.max_restarts=0")
    fleet = _fleet(proc.pid)
    server = next(p for p in fleet if "server" in p.cmdline())
    server.kill()
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1
    assert "server_0" in err and "SIGKILL" in err
    _assert_all_gone(fleet)


def test_ctrl_c_stops_every_process(tmp_path):
    """Started as a background job of a script starts it (SIGINT inherited ignored: the local
    CI run that found this left the fleets training for 20 minutes), SIGINT still stops it."""
    proc, _ = _start(tmp_path, sigint_ignored=True)
    fleet = _fleet(proc.pid)
    assert len(fleet) >= 3  # replay, server, learner
    proc.send_signal(signal.SIGINT)
    try:
        _, err = proc.communicate(timeout=60)
    finally:  # never leave a fleet training behind a failed test
        for p in [proc, *fleet]:
            with contextlib.suppress(psutil.NoSuchProcess, ProcessLookupError):
                p.kill()
    assert proc.returncode == 130 and "interrupted" in err
    _assert_all_gone(fleet)


def _member(launcher_pid: int, name: str) -> psutil.Process:
    """The fleet process `name`: a direct child of the launcher (its own children, such as
    reward workers, inherit ASYNCRL_PROCESS too)."""
    children = psutil.Process(launcher_pid).children()
    return next(p for p in children if p.environ().get("ASYNCRL_PROCESS") == name)


def _reapable(pid: int) -> bool:
    """Whether the process has ended and its parent could reap it now: a zombie with none of
    its threads left (a zombie leader whose threads still exit is not reaped yet)."""
    try:
        return len(os.listdir(f"/proc/{pid}/task")) == 1 and psutil.Process(pid).status() == (
            psutil.STATUS_ZOMBIE
        )
    except (FileNotFoundError, psutil.NoSuchProcess):
        return True


def _failure(err: str) -> tuple[str, str]:
    """The report's first line (the cause) and its `then:` line ('' without one)."""
    lines = err.split("asyncrl: launch failed: ", 1)[1].splitlines()
    return lines[0], lines[1] if lines[1].startswith("then: ") else ""


@pytest.mark.long  # half a minute or more: its own CI step
def test_a_killed_learner_is_named_not_server_0_that_died_of_it(tmp_path):
    """While the launcher is busy (here: stopped) learner_0 is killed; each server's weight sync
    fails and the servers die of it: all three ends pile up for one check. server_0 was started
    first and died after the learner; learner_0 is named, the servers follow it."""
    proc, _ = _start(tmp_path, "rollout.num_servers=2", "launch.max_restarts=0")
    fleet = _fleet(proc.pid)
    members = {name: _member(proc.pid, name) for name in ("server_0", "server_1", "learner_0")}
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        members["learner_0"].kill()
        deadline = time.monotonic() + 30
        while not _reapable(members["server_0"].pid):
            assert time.monotonic() < deadline, "server_0 did not die of learner_0's death"
            time.sleep(0.05)
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1
    cause, then = _failure(err)
    assert cause == "process learner_0 was killed by signal SIGKILL", err
    assert re.match(r"then: .*server_0 exited with code 1", then), err
    _assert_all_gone(fleet)


@pytest.mark.long  # half a minute or more: its own CI step
def test_deaths_after_the_first_are_listed_with_how_much_later(tmp_path):
    """Left alone, the launcher wakes at server_1's death, then waits a moment for the deaths
    it causes (the learner's at its next broadcast) and lists them."""
    proc, _ = _start(tmp_path, "rollout.num_servers=2", "launch.max_restarts=0")
    fleet = _fleet(proc.pid)
    _member(proc.pid, "server_1").kill()
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1
    cause, then = _failure(err)
    assert cause == "process server_1 was killed by signal SIGKILL", err
    if then:  # a follower, if one died within the window, is listed after the cause
        assert re.match(r"then: \w+ (exited with code|was killed by signal) \S+ \(", then), err
        assert "server_1" not in then, err
    _assert_all_gone(fleet)


def test_the_local_fleet_orders_exits_by_time_not_start_order(tmp_path):
    """Real child processes: server_0 (started first) exits 0.6 s after server_1 is killed;
    server_1 is named and server_0 follows it, stamped within milliseconds of each exit."""
    fleet = LocalFleet(RunSpec(str(tmp_path), "", "", "", 0, 0, 1))
    # each ends at a wall-clock time set here, so their starts (a fork of this large process
    # and an interpreter start each, skewed by up to 0.2 s under load) do not shift the gap
    code = (
        "import os, signal, sys, time; time.sleep(max(0, {} - time.time())); "
        "print('{}', flush=True); {}"
    )
    exit_1 = "sys.exit(1)"
    kill_self = "os.kill(os.getpid(), signal.SIGKILL)"
    at = time.time() + 1.5
    fleet.start("server_0", [sys.executable, "-c", code.format(at + 0.6, "dying", exit_1)], {})
    fleet.start("server_1", [sys.executable, "-c", code.format(at, "killed", kill_self)], {})
    try:
        while not fleet.failures():
            fleet.wait(5.0)
        with pytest.raises(LaunchError) as e:
            raise_on_failure(fleet, window_s=3.0)
    finally:
        fleet.stop_all()
    lines = str(e.value).splitlines()
    assert lines[0] == "process server_1 was killed by signal SIGKILL"
    later = re.fullmatch(r"then: server_0 exited with code 1 \((\d\.\d) s later\)", lines[1])
    assert later and 0.4 <= float(later.group(1)) <= 0.9, lines[1]
    assert lines[2:] == [f"last lines of {tmp_path / 'logs' / 'server_1.log'}:", "killed"]


def test_exits_seen_together_are_ordered_by_their_logs(tmp_path):
    """Both children are dead before the first check (a busy launcher): the one killed without
    a word is named, the one that wrote on its way out follows."""
    fleet = LocalFleet(RunSpec(str(tmp_path), "", "", "", 0, 0, 1))
    fleet.start(
        "server_0", [sys.executable, "-c", "import time; time.sleep(0.4); print('bye')"], {}
    )
    fleet.start("server_1", ["sh", "-c", "sleep 0.1; kill -9 $$"], {})
    time.sleep(1.5)
    try:
        with pytest.raises(LaunchError) as e:
            raise_on_failure(fleet, window_s=3.0)
    finally:
        fleet.stop_all()
    lines = str(e.value).splitlines()
    assert lines[0] == "process server_1 was killed by signal SIGKILL"
    assert lines[1].startswith("then: server_0 exited with code 0 (seen together with it;")


def test_a_retired_server_is_killed_even_when_stopped_and_starts_again_as_its_next_epoch(
    tmp_path,
):
    """What `restarts.ServerRestarts` asks of the local fleet: `retire` SIGKILLs a hung (here:
    stopped) server and its children and forgets it, so its end is no failure; `start_server`
    runs the same command again with the next epoch on its command line (`--epoch`,
    `asyncrl.launch.worker`) and that epoch's key (`asyncrl.wire.auth`) in its environment,
    appending to its log."""
    write_secret(tmp_path, new_secret())
    fleet = LocalFleet(RunSpec(str(tmp_path), "", "", "", 0, 0, 1))
    code = (
        "import os, sys, time; key = os.environ.get('ASYNCRL_AUTH_KEY', '-').partition(':')[0]; "
        "print('epoch', sys.argv[sys.argv.index('--epoch') + 1], key, flush=True); "
    )
    argv = [sys.executable, "-c", code + "os.system('sleep 60'); time.sleep(60)", "--epoch", "0"]
    first = fleet.start("server_0", argv, {})
    try:
        time.sleep(0.5)
        grandchildren = psutil.Process(first.popen.pid).children(recursive=True)
        os.kill(first.popen.pid, signal.SIGSTOP)
        fleet.retire("server_0")
        assert first.popen.returncode == -signal.SIGKILL and fleet.procs == []
        _assert_all_gone(grandchildren)  # the whole process group
        assert fleet.failures() == []
        fleet.start_server(0, epoch=2)
        (again,) = fleet.procs
        time.sleep(1.0)
        assert again.popen.poll() is None and fleet.failures() == []
    finally:
        fleet.stop_all(grace_s=1.0)
    log = (tmp_path / "logs" / "server_0.log").read_text().splitlines()
    restarted = "---- asyncrl: server_0 restarted as epoch 2 ----"
    assert log == ["epoch 0 -", restarted, "epoch 2 server_0@2"]


# ---- a dataset the run cannot use fails before any process starts ----------------------------
def _cli(tmp_path: Path, command: str, *args: str) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "asyncrl.launch.cli", command, *args]
    if command != "eval":
        argv += [
            f"trainer.run_dir={tmp_path / 'run'}",
            f"trainer.cache_dir={tmp_path / 'cache'}",
            "trainer.total_steps=2",
            "trainer.warmstart_steps=10",
        ]
    return subprocess.run(argv, capture_output=True, text=True, timeout=300)


def _assert_failed_fast(result: subprocess.CompletedProcess, tmp_path: Path, *named: str) -> None:
    """Exit code 2, one line naming each of `named`, and nothing started or created."""
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("asyncrl: "), result.stderr
    for text in named:
        assert text in lines[0], result.stderr
    assert not (tmp_path / "run").exists() and not (tmp_path / "cache").exists()


def _row(source: str, i: int = 0) -> dict:
    return {
        "data_source": source,
        "prompt": [{"role": "user", "content": f"{i}+1="}],
        "reward_model": {"style": "rule", "ground_truth": str(i + 1)},
    }


def test_a_missing_validation_file_is_named_before_anything_starts(tmp_path):
    missing = tmp_path / "val.parquet"
    result = _cli(tmp_path, "launch", f"data.val_files=[{missing}]")
    _assert_failed_fast(result, tmp_path, "data.val_files", str(missing), "does not exist")


def test_an_unknown_data_source_fails_fast_naming_it(tmp_path):
    """Without the check the run trained to its end on a reward of 0, and exited 0."""
    train = write_rows([_row("asyncrl/arith"), _row("mystery/source", 1)], tmp_path / "t.parquet")
    result = _cli(tmp_path, "launch", f"data.train_files=[{train}]")
    _assert_failed_fast(result, tmp_path, "'mystery/source'", str(train), "'asyncrl/arith'")
    result = _cli(tmp_path, "serve", f"data.val_files=[{train}]")
    _assert_failed_fast(result, tmp_path, "'mystery/source'")


def test_a_missing_empty_or_wrong_schema_training_file_fails_fast(tmp_path):
    empty = tmp_path / "empty.parquet"
    write_rows([_row("asyncrl/arith")], empty)
    pq.write_table(pq.read_table(empty).slice(0, 0), empty)
    no_prompt = write_rows(
        [{"data_source": "asyncrl/arith", "reward_model": {"ground_truth": "1"}}],
        tmp_path / "np.parquet",
    )
    cases = {
        tmp_path / "absent.parquet": "does not exist",
        empty: "has no rows",
        no_prompt: "no column 'prompt'",
    }
    for path, why in cases.items():
        result = _cli(tmp_path, "launch", f"data.train_files=[{path}]")
        _assert_failed_fast(result, tmp_path, "data.train_files", str(path), why)


def test_eval_checks_its_files_before_starting_a_fleet(tmp_path):
    bad = write_rows([_row("mystery/source")], tmp_path / "eval.parquet")
    result = _cli(tmp_path, "eval", f"trainer.run_dir={tmp_path / 'run'}", "--data", str(bad))
    _assert_failed_fast(result, tmp_path, "'mystery/source'", str(bad))
