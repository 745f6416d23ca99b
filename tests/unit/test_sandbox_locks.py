"""Sandbox uid lock files: claimed with an flock, and removed when their owner releases them,
so /run/asyncrl-sandbox holds nothing after a run (issue 30)."""

from __future__ import annotations

import os

from rollout_servers.sandbox import host


def test_lock_files_are_removed_on_release_and_a_held_uid_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(host, "_UID_LOCK_DIR", str(tmp_path))
    fd = host._lock_uid(7)
    assert fd is not None and os.listdir(tmp_path) == ["7.lock"]
    assert host._lock_uid(7) is None  # another claimer while it is held
    host._release_uid(7, fd)
    assert os.listdir(tmp_path) == []
    again = host._lock_uid(7)
    assert again is not None
    host._release_uid(7, again)
    assert os.listdir(tmp_path) == []


def test_a_lock_on_a_file_already_removed_is_not_a_claim(tmp_path, monkeypatch):
    """A claimer that opened the file just before its owner removed it must not count the
    lock it then takes on the removed file: it claims the new file at the path instead."""
    monkeypatch.setattr(host, "_UID_LOCK_DIR", str(tmp_path))
    stale = os.open(tmp_path / "7.lock", os.O_CREAT | os.O_RDWR)
    os.unlink(tmp_path / "7.lock")  # what the owner's release does, between open and flock
    real_open = os.open
    calls = []

    def open_then_stale(path, flags, *args):
        calls.append(path)
        return os.dup(stale) if len(calls) == 1 else real_open(path, flags, *args)

    monkeypatch.setattr(host.os, "open", open_then_stale)
    fd = host._lock_uid(7)
    assert fd is not None and len(calls) == 2  # the stale file was seen and dropped
    assert os.path.samestat(os.fstat(fd), os.stat(tmp_path / "7.lock"))
    host._release_uid(7, fd)
    os.close(stale)
