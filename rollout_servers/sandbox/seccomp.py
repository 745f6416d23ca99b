"""A seccomp filter for sandboxed code: deny the system calls that could carry data from one
run to the next or reach beyond the run, whatever the namespaces leave open.

Denied with EPERM (a program that probes for them sees an ordinary error):
- `add_key`, `request_key`, `keyctl`: kernel keyrings belong to a uid, not to a namespace, so a
  key added by one run would be readable by the next run on the same slot uid;
- `ptrace`, `process_vm_readv`, `process_vm_writev`: reading or steering another process;
- `perf_event_open`, `bpf`, `userfaultfd`, `io_uring_setup/enter/register`: kernel attack
  surface no test program needs;
- every system call of a foreign ABI (i386 or x32 on x86_64), so the list cannot be bypassed
  through another entry point.

The prelude installs the program (PR_SET_SECCOMP) after dropping privileges and setting
no_new_privs, right before the code runs, for every backend. Built here as raw classic BPF.
"""

from __future__ import annotations

import platform
import struct

_AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
_DENIED = {
    "x86_64": {
        "ptrace": 101,
        "add_key": 248,
        "request_key": 249,
        "keyctl": 250,
        "perf_event_open": 298,
        "process_vm_readv": 310,
        "process_vm_writev": 311,
        "bpf": 321,
        "userfaultfd": 323,
        "io_uring_setup": 425,
        "io_uring_enter": 426,
        "io_uring_register": 427,
    },
    "aarch64": {
        "ptrace": 117,
        "add_key": 217,
        "request_key": 218,
        "keyctl": 219,
        "perf_event_open": 241,
        "process_vm_readv": 270,
        "process_vm_writev": 271,
        "bpf": 280,
        "userfaultfd": 282,
        "io_uring_setup": 425,
        "io_uring_enter": 426,
        "io_uring_register": 427,
    },
}
_X32_BIT = 0x40000000

_LD_W_ABS = 0x20  # BPF_LD | BPF_W | BPF_ABS
_JEQ_K = 0x15  # BPF_JMP | BPF_JEQ | BPF_K
_JGE_K = 0x35  # BPF_JMP | BPF_JGE | BPF_K
_RET_K = 0x06  # BPF_RET | BPF_K
_ALLOW = 0x7FFF0000  # SECCOMP_RET_ALLOW
_EPERM = 0x00050000 | 1  # SECCOMP_RET_ERRNO | EPERM


def _insn(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k)


def filter_program(machine: str | None = None) -> bytes:
    """The filter as `struct sock_filter` records (8 bytes each), for PR_SET_SECCOMP.

    Raises RuntimeError on an architecture without a table here."""
    machine = machine or platform.machine()
    if machine not in _DENIED:
        raise RuntimeError(f"no seccomp table for {machine!r} (have {sorted(_DENIED)})")
    numbers = sorted(_DENIED[machine].values())
    n = len(numbers)
    body = [_insn(_LD_W_ABS, 4)]  # seccomp_data.arch
    # layout after the checks: [ret ALLOW, ret EPERM]; jumps are relative to the next insn
    tail = n + (1 if machine == "x86_64" else 0) + 1  # instructions between here and EPERM
    body.append(_insn(_JEQ_K, _AUDIT_ARCH[machine], jt=1, jf=0))
    body.append(_insn(_RET_K, _EPERM))  # a foreign ABI: nothing allowed
    body.append(_insn(_LD_W_ABS, 0))  # seccomp_data.nr
    if machine == "x86_64":
        body.append(_insn(_JGE_K, _X32_BIT, jt=tail - 1, jf=0))
        tail -= 1
    for i, nr in enumerate(numbers):
        body.append(_insn(_JEQ_K, nr, jt=n - i, jf=0))
    body.append(_insn(_RET_K, _ALLOW))
    body.append(_insn(_RET_K, _EPERM))
    return b"".join(body)
