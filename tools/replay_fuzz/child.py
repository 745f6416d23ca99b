"""The replay under test, in a process of its own, so that a crash is a crash.

    python child.py CONFIG_JSON ADDRESS REPORT_PATH [--survive]

It runs the real `ReplayService` until SIGTERM. The only addition is a recorder around its
message handler: when an exception escapes the handling of a message, the exception, its
traceback and the message's frames are appended to REPORT_PATH (a MessagePack stream) before
the exception goes on and ends the process (exit 3): the fuzzer reports it with the exact
message that caused it. An exception that escapes the loop elsewhere is reported with the last
messages handled. With --survive the exception is recorded and the loop goes on: a way to find
every kind of crash in one run, never what an acceptance run uses.

Run as a script (the fuzzer puts the checkout first on PYTHONPATH): it imports only the core
and the replay, never the fuzzer package.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import signal
import sys
import threading
import traceback
from typing import Any

import msgpack

from asyncrl.config import Config
from replay.prompts import setup_prompt_source
from replay.service import ReplayService

EXIT_CRASHED = 3
MAX_FRAME_KEPT = 1 << 20  # bytes of each frame kept in a report


class RecordingReplay(ReplayService):
    """The replay, with every exception that escapes a message's handling written down."""

    def __init__(self, cfg: Config, address: str, report_path: str, survive: bool) -> None:
        super().__init__(cfg, address, setup_prompt_source(cfg))
        self.report_path = report_path
        self.survive = survive
        self.recent: collections.deque[list[Any]] = collections.deque(maxlen=8)
        self.recorded: BaseException | None = None  # the last exception written down

    def _handle(self, frames: list[Any]) -> None:
        self.recent.append(frames)
        try:
            super()._handle(frames)
        except Exception as e:
            self.record("handler", e, [frames])
            if not self.survive:
                raise

    def record(self, where: str, error: BaseException, messages: list[list[Any]]) -> None:
        self.recorded = error
        entry = {
            "where": where,
            "type": type(error).__name__,
            "error": _safe_str(error)[:2000],
            # the frames only: the error's text can be huge (it may echo the message)
            "traceback": "".join(traceback.format_tb(error.__traceback__))[-20_000:],
            # each message as received: [identity, *body frames]
            "messages": [[_frame_bytes(f)[:MAX_FRAME_KEPT] for f in m] for m in messages],
        }
        with open(self.report_path, "ab") as f:
            f.write(msgpack.packb(entry, use_bin_type=True))


def _frame_bytes(frame: Any) -> bytes:
    return frame.bytes if hasattr(frame, "bytes") else bytes(frame)


def _safe_str(error: BaseException) -> str:
    try:
        return str(error)
    except Exception as e:  # the error's own text can fail (deep nesting): say so instead
        return f"<str() of the error failed: {type(e).__name__}>"


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    cfg = Config.model_validate(json.loads(argv[1]))
    service = RecordingReplay(cfg, argv[2], argv[3], survive="--survive" in argv)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        service.run(stop)
    except Exception as e:
        if e is not service.recorded:
            service.record("loop", e, list(service.recent))
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(EXIT_CRASHED)  # a crash is a crash: no clean shutdown of the sockets
    service.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
