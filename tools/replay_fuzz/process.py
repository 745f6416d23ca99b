"""The replay process under test: start it, watch it, read its crash reports, measure it.

The child (`child.py`) runs with the checkout this file belongs to first on PYTHONPATH, so the
replay under test is this checkout's, whatever `asyncrl` the fuzzer's own interpreter imports.
Its working directory is `scratch/cwd`: a relative checkpoint path lands inside the scratch
directory. Its log (warnings of rejected messages, a crash's traceback) goes to a file there.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgpack

from asyncrl.wire.sockets import free_port, tcp_address

ROOT = Path(__file__).resolve().parents[2]
CHILD = Path(__file__).resolve().parent / "child.py"


def rss_mb(pid: int, field: str = "VmRSS") -> float:
    """A memory figure of process `pid` from /proc (VmRSS: now; VmHWM: peak), MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return 0.0


class ReplayProcess:
    """One replay process at a time; `start` again after a crash gives a fresh one."""

    def __init__(
        self, config: dict[str, Any], scratch: Path, survive: bool, env: dict[str, str] | None
    ) -> None:
        self.config, self.scratch, self.survive = config, scratch, survive
        self.env = env or {}
        self.proc: subprocess.Popen | None = None
        self.starts = 0
        self.address = ""
        self.report_path = scratch / "crashes-0.msgpack"
        self.log_path = scratch / "replay-0.log"
        self._report_offset = 0

    def start(self) -> str:
        """Start a replay on a free loopback port; its address (it may still be starting)."""
        self.starts += 1
        self.address = tcp_address("127.0.0.1", free_port())
        self.report_path = self.scratch / f"crashes-{self.starts}.msgpack"
        self.log_path = self.scratch / f"replay-{self.starts}.log"
        self._report_offset = 0
        cmd = [sys.executable, str(CHILD), json.dumps(self.config), self.address]
        cmd += [str(self.report_path), "--run-dir", str(self.scratch / "run")]
        cmd += ["--survive"] if self.survive else []
        path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
        env = {**os.environ, **self.env, "PYTHONPATH": path}
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                cmd, cwd=self.scratch / "cwd", env=env, stdout=log, stderr=subprocess.STDOUT
            )
        return self.address

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def exit_code(self) -> int | None:
        """None while it runs."""
        return None if self.proc is None else self.proc.poll()

    def rss_mb(self) -> float:
        return rss_mb(self.pid)

    def peak_rss_mb(self) -> float:
        return rss_mb(self.pid, "VmHWM")

    def new_crash_reports(self) -> list[dict[str, Any]]:
        """Crash reports written since the last call (see `child.RecordingReplay.record`)."""
        if not self.report_path.exists():
            return []
        with open(self.report_path, "rb") as f:
            f.seek(self._report_offset)
            data = f.read()
        unpacker = msgpack.Unpacker(raw=False, max_buffer_size=max(len(data), 1 << 20))
        unpacker.feed(data)
        reports, used = [], 0
        for entry in unpacker:
            reports.append(entry)
            used = unpacker.tell()
        self._report_offset += used
        return reports

    def log_tail(self, chars: int = 3000) -> str:
        if not self.log_path.exists():
            return ""
        return self.log_path.read_bytes()[-chars:].decode(errors="replace")

    def stop(self, timeout_s: float = 10.0) -> int | None:
        """SIGTERM, then SIGKILL after `timeout_s`; the exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
