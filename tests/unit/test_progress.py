"""The launcher's status line: whole when piped, fitted to the terminal's width on a terminal
(a wrapped line leaves a fragment behind at every rewrite)."""

from __future__ import annotations

import io
import time

from asyncrl.launch.progress import Progress

ROW = {
    "step": 12,
    "reward_mean": 0.5123,
    "staleness_mean": 0.83,
    "staleness_max": 2,
    "samples_per_s": 31.2,
    "gen_tokens_per_s": 2543.0,
    "learner_idle_ratio": 0.41,
}


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_piped_line_is_whole():
    out = io.StringIO()
    Progress(60, 2, "auto", time.monotonic(), stream=out).update([ROW], final=True)
    line = out.getvalue()
    assert line.startswith("step 12/60 | reward 0.512 | staleness 0.83 (max 2/2)")
    assert "learner idle 41%" in line and "\r" not in line


def test_on_an_80_column_terminal_the_line_fits(monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    out = _Terminal()
    Progress(60, 2, "auto", time.monotonic(), stream=out).update([ROW])
    line = out.getvalue().removeprefix("\r\x1b[2K")
    assert len(line) <= 79, line
    assert line.startswith("step 12/60 | reward 0.512 | staleness 0.83")
    assert "learner idle" not in line  # the least useful field went first


def test_narrower_terminals_drop_fields_in_order_and_never_exceed_the_width():
    p = Progress(60, 2, "tty", time.monotonic(), stream=_Terminal())
    full = p.render([ROW])
    for width in (200, 100, 79, 60, 40, 25, 10):
        line = p.render([ROW], width)
        assert len(line) <= width
        assert line == full[:width] or line.startswith("step 12/60")
    assert p.render([ROW], 200) == full
    assert p.render([ROW], 25).startswith("step 12/60 | reward")
