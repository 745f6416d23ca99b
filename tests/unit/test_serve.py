"""`asyncrl.wire.serve.serve_until_signal`: a stop signal ends the loop; then, whether the loop
stopped or raised, the service is closed, the signal handlers are put back and the final counters
are written and logged."""

from __future__ import annotations

import json
import logging
import os
import signal
import threading

import pytest

from asyncrl.wire.serve import STOP_SIGNALS, serve_until_signal


class FakeService:
    def __init__(self, fail: bool = False) -> None:
        self.fail, self.closed, self.ticks = fail, False, 0

    def run(self, stop: threading.Event | None = None) -> dict[str, float]:
        assert stop is not None
        if self.fail:
            raise RuntimeError("the loop broke")
        os.kill(os.getpid(), signal.SIGTERM)  # what the launcher sends
        while not stop.wait(0.01):
            self.ticks += 1
        return self.stats()

    def stats(self) -> dict[str, float]:
        return {"handled": 3.0}

    def close(self, linger_ms: int = 100) -> None:
        self.closed = True


def _summary(counters: dict[str, float]) -> str:
    return f"{int(counters['handled'])} handled"


@pytest.mark.parametrize("fail", [False, True])
def test_serves_until_a_stop_signal_then_closes_writes_and_logs(tmp_path, caplog, fail):
    before = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    service, path = FakeService(fail), tmp_path / "stats" / "svc.json"
    log = logging.getLogger("test.serve")
    with caplog.at_level(logging.INFO, logger="test.serve"):
        if fail:
            with pytest.raises(RuntimeError, match="the loop broke"):
                serve_until_signal(service, path, _summary, "svc", log)
        else:
            serve_until_signal(service, path, _summary, "svc", log)
    assert service.closed
    assert json.loads(path.read_text()) == {"handled": 3.0}
    assert "svc done: 3 handled" in caplog.text
    assert {sig: signal.getsignal(sig) for sig in STOP_SIGNALS} == before
