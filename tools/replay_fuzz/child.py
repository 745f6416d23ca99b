"""The replay under test, in a process of its own, so that a crash is a crash.

    python child.py CONFIG_JSON ADDRESS REPORT_PATH --run-dir DIR [--survive]

It runs the real `ReplayService` until SIGTERM. The only addition is a recorder around its
message handling: when an exception escapes the handling of a message, the exception, its
traceback and the message's frames are appended to REPORT_PATH (a MessagePack stream) before
the exception goes on and ends the process (exit 3): the fuzzer reports it with the exact
message that caused it. An exception that escapes the loop elsewhere is reported with the last
messages handled. With --survive the exception is recorded and the loop goes on: a way to find
every kind of crash in one run, never what an acceptance run uses.

A replay that contains handler exceptions itself (it counts them as `handler_errors` and goes
on) is recorded the same way, one level down (`_dispatch`), and left to go on.

Run as a script (the fuzzer puts the checkout first on PYTHONPATH): it imports only the core
and the replay, never the fuzzer package. A replay that authenticates takes the run secret
from the environment (`ASYNCRL_RUN_SECRET`) and writes checkpoints only inside --run-dir.
"""

from __future__ import annotations

import argparse
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
from asyncrl.wire.auth import secret_from_env
from replay.components import setup_replay_components
from replay.service import ReplayService

EXIT_CRASHED = 3


class RecordingReplay(ReplayService):
    """The replay, with every exception that escapes a message's handling written down."""

    def __init__(self, cfg: Config, address: str, args: argparse.Namespace) -> None:
        parts = setup_replay_components(cfg, secret_from_env(), args.run_dir)
        super().__init__(cfg, address, parts)
        self.report_path, self.survive = args.report, args.survive
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

    def _dispatch(self, body: list[Any]) -> Any:
        """Writes down a handler exception, which `RouterService._handle` then counts and
        contains."""
        try:
            return super()._dispatch(body)
        except Exception as e:
            self.record("contained", e, [self.recent[-1]])
            raise

    def record(self, where: str, error: BaseException, messages: list[list[Any]]) -> None:
        self.recorded = error
        entry = {
            "where": where,
            "type": type(error).__name__,
            "error": _safe_str(error)[:2000],
            # the frames only: the error's text can be huge (it may echo the message)
            "traceback": "".join(traceback.format_tb(error.__traceback__))[-20_000:],
            # each message as received, whole: [identity, *body frames]
            "messages": [[_frame_bytes(f) for f in m] for m in messages],
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
    parser = argparse.ArgumentParser()
    parser.add_argument("config", help="the replay's Config, JSON")
    parser.add_argument("address")
    parser.add_argument("report", help="where crash reports are appended")
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--survive", action="store_true")
    args = parser.parse_args(argv[1:])
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    cfg = Config.model_validate(json.loads(args.config))
    service = RecordingReplay(cfg, args.address, args)
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
