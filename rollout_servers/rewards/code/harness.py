"""The harness: the trusted program each code-reward sample's sandbox run executes, with the
candidate as data. Everything it writes on its stdout is a *claim* the judge checks.

- stdin/stdout cases: each case is a fork of the candidate with that case's stdin; the claim is
  what it printed (up to `max_output` bytes, `truncated` past it) and its exit status.
- program cases: the candidate module runs once; then each unit's sandbox program
  (`plan`) runs in its namespace, after `random.seed(seed)` so that tests drawing random
  inputs draw the same ones as the judge. Each `__leaves` call claims the plain values of one
  execution's leaves (`{"u": unit, "v": [...]}`), or the error one raised (`"e"`), or
  `"e": "truncated"` when the claim would be over `max_value` characters or its value is nested
  deeper than `plain` goes; after an error the unit stops, as it would in the judge. Each unit
  has `timeout` seconds. Ints of any length are values (`sys.set_int_max_str_digits(0)`).

The candidate shares the harness's process and can forge any claim; that is why the verdict is
only ever computed from claimed *values* by the judge, never from the harness's say-so.
"""

from __future__ import annotations

import inspect
import json

from rollout_servers.rewards.code.plan import CodeChecks
from rollout_servers.rewards.code.values import plain, unplain

_HARNESS = r"""
import json, os, random, signal, sys, select, time
job = json.loads(sys.stdin.read())
sys.set_int_max_str_digits(0)  # an int over 4300 digits is a value like any other
claims = os.fdopen(os.dup(1), "w", buffering=1)
devnull = os.open(os.devnull, os.O_RDWR)
def claim(**fields):
    claims.write(json.dumps(fields, ensure_ascii=False) + "\n")
def on_alarm(signum, frame):
    raise TimeoutError("case time limit")
class Abort(BaseException):
    pass
def leaves(unit, thunks):
    values = []
    for thunk in thunks:
        try:
            value = thunk()
        except BaseException as exc:
            claim(u=unit, e=type(exc).__name__)
            raise Abort() from None
        try:
            values.append(plain(value))
        except (ValueError, RecursionError):  # nested past plain's depth: a size limit
            claim(u=unit, e="truncated")
            raise Abort() from None
        except BaseException as exc:
            claim(u=unit, e=type(exc).__name__)
            raise Abort() from None
    try:
        line = json.dumps({"u": unit, "v": values}, ensure_ascii=False)
    except BaseException as exc:
        claim(u=unit, e=type(exc).__name__)
        raise Abort() from None
    if len(line) > job["max_value"]:
        claim(u=unit, e="truncated")
        raise Abort()
    claims.write(line + "\n")
    return [unplain(v) for v in values]
def entry(name):
    solution = namespace.get("Solution")
    if isinstance(solution, type) and hasattr(solution, name):
        return getattr(solution(), name)
    return namespace[name]
if job["mode"] == "program":
    os.dup2(devnull, 0); os.dup2(devnull, 1); os.dup2(devnull, 2)
    namespace = {"__name__": "__main__"}
    try:
        exec(compile(job["code"], "main.py", "exec"), namespace)
    except BaseException as exc:
        claim(error="module: " + type(exc).__name__)
        os._exit(0)
    namespace.update(__leaves=leaves, __entry__=entry)
    signal.signal(signal.SIGALRM, on_alarm)
    random.seed(job["seed"])
    for unit, source in enumerate(job["units"]):
        signal.setitimer(signal.ITIMER_REAL, job["timeout"])
        try:
            exec(compile(source, "<test %d>" % unit, "exec"), namespace)
        except BaseException:
            pass
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
    os._exit(0)
for case, stdin in enumerate(job["cases"]):
    rin, win = os.pipe()
    rout, wout = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.setpgid(0, 0)
        os.dup2(rin, 0); os.dup2(wout, 1); os.dup2(devnull, 2)
        os.closerange(3, 1 << 16)
        code = 0
        try:
            exec(compile(job["code"], "main.py", "exec"), {"__name__": "__main__"})
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except BaseException:
            code = 1
        try:
            sys.stdout.flush()
        except BaseException:
            code = code or 1
        os._exit(code & 0xFF)
    os.close(rin); os.close(wout)
    os.set_blocking(win, False)
    data, sent = stdin.encode(), 0
    out, truncated, status = bytearray(), False, None
    deadline = time.monotonic() + job["timeout"]
    reading = True
    while reading and (left := deadline - time.monotonic()) > 0:
        writers = [win] if sent < len(data) else []
        ready, writable, _ = select.select([rout], writers, [], left)
        if writable:
            try:
                sent += os.write(win, data[sent:sent + (1 << 16)])
            except BlockingIOError:
                pass
            except OSError:  # the program closed its stdin
                sent = len(data)
            if sent >= len(data):
                os.close(win); win = -1
        if ready:
            chunk = os.read(rout, 1 << 16)
            reading = bool(chunk)
            room = job["max_output"] - len(out)
            truncated = truncated or len(chunk) > room
            out += chunk[:max(0, room)]
            if truncated:
                break
    if win >= 0:
        os.close(win)
    if truncated:  # its verdict is known: do not wait for it to block on a full pipe
        try:
            os.killpg(pid, signal.SIGKILL)
        except OSError:
            pass
    while status is None and time.monotonic() < deadline:
        done, st = os.waitpid(pid, os.WNOHANG)
        status = st if done else None
        if status is None:
            time.sleep(0.001)
    try:
        os.killpg(pid, signal.SIGKILL)  # whatever the case started
    except OSError:
        pass
    os.close(rout)
    if status is None:
        os.waitpid(pid, 0)
    exit_code = None if status is None else os.waitstatus_to_exitcode(status)
    text = out.decode("utf-8", "replace")
    claim(case=case, exit=exit_code, stdout=text, truncated=truncated)
os._exit(0)
"""

HARNESS = (
    "\n".join(
        ["from __future__ import annotations", inspect.getsource(plain), inspect.getsource(unplain)]
    )
    + _HARNESS
)
"""The trusted program each sample's sandbox run executes (with the candidate as data)."""


def harness_stdin(
    code: str, checks: CodeChecks, *, case_timeout_s: float, max_output: int, max_value: int,
    seed: int,
) -> str:  # fmt: skip
    """The harness's input: the candidate and what to run for each case, nothing expected."""
    job = {
        "code": code, "mode": checks.mode, "timeout": case_timeout_s, "max_output": max_output,
        "max_value": max_value, "seed": seed,
    }  # fmt: skip
    job["cases" if checks.mode == "io" else "units"] = (
        checks.inputs if checks.mode == "io" else checks.sandbox_units
    )
    return json.dumps(job)
