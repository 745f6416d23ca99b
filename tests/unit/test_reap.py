"""`asyncrl.launch.local.reap`: the launcher's wait for a SIGKILLed child is bounded, so a
process stuck in the kernel (which SIGKILL cannot end until its call returns) does not hang the
run's stop or a server's restart."""

from __future__ import annotations

import signal
import subprocess
import sys

from asyncrl.launch.local import reap


class _StuckInTheKernel:
    """What `Popen.wait` does for a process in uninterruptible sleep: it never ends."""

    pid = 4242

    def wait(self, timeout: float | None = None) -> int:
        assert timeout is not None, "an unbounded wait would hang the launcher"
        raise subprocess.TimeoutExpired("worker", timeout)


def test_a_child_that_does_not_end_after_sigkill_is_left_behind_by_name(capsys):
    assert reap(_StuckInTheKernel(), "server_1", timeout_s=0.1) is False
    out = capsys.readouterr().out
    assert "asyncrl: server_1 (pid 4242) has not ended 0.1 s after SIGKILL" in out


def test_a_killed_child_is_reaped():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    child.send_signal(signal.SIGKILL)
    assert reap(child, "server_0", timeout_s=10) is True
    assert child.returncode == -signal.SIGKILL
