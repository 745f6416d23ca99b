"""What this CPU can do, read from /proc/cpuinfo: the learner's bf16 choice and the SGLang CPU
engine's check both ask here."""

from __future__ import annotations

from pathlib import Path


def cpu_flags(cpuinfo: str | None = None) -> frozenset[str] | None:
    """The words of /proc/cpuinfo's `flags` (x86) and `Features` (Arm) lines, from `cpuinfo`'s
    text in tests; None when it cannot be read (not Linux)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return None
    words: set[str] = set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            words.update(value.split())
    return frozenset(words)
