"""tools/hosts.py refuses clearly where simulated hosts cannot be made (no root, no iproute2,
no util-linux), before making anything; the `simulated_hosts` fixture skips with that reason.
The checks are patched here, so this runs anywhere, as any user."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def fixture_module():
    """tests/integration/simulated_hosts.py (the fixture's module), imported from its path."""
    path = ROOT / "tests" / "integration" / "simulated_hosts.py"
    spec = importlib.util.spec_from_file_location("simulated_hosts_under_test", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def tool(fixture_module):
    return fixture_module.load_hosts_tool()


@pytest.fixture
def machine_without(monkeypatch, tool):
    """Patches the checks: not root (uid 1000), and the commands given missing."""

    def without(*commands: str) -> None:
        monkeypatch.setattr(tool.os, "geteuid", lambda: 1000)
        which = tool.shutil.which
        monkeypatch.setattr(tool.shutil, "which", lambda c: None if c in commands else which(c))

    return without


def test_each_missing_requirement_is_named(machine_without, tool):
    machine_without("ip", "nsenter")
    assert tool.missing_requirements() == [
        "root is needed (namespaces, links, mounts); running as uid 1000",
        "`ip` (iproute2) is not installed",
        "`nsenter` (util-linux) is not installed",
    ]


def test_up_refuses_before_making_anything(machine_without, tool, tmp_path):
    machine_without("unshare")
    hosts = tool.SimulatedHosts(2, state_dir=tmp_path / "state")
    with pytest.raises(tool.HostsUnavailable, match=r"uid 1000; `unshare` \(util-linux\)"):
        hosts.up()
    assert not (tmp_path / "state").exists()


def test_the_command_line_refuses_with_status_2(machine_without, tool, capsys):
    machine_without("ip")
    assert tool.main(["up", "2"]) == 2
    err = capsys.readouterr().err
    assert "hosts.py: simulated hosts are unavailable: root is needed" in err
    assert "`ip` (iproute2) is not installed" in err


def test_the_fixture_skips_with_the_reason(machine_without, tool, fixture_module, monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    machine_without("ip", "mount")
    with pytest.raises(pytest.skip.Exception, match=r"`mount` \(util-linux\) is not installed"):
        fixture_module.skip_unless_hosts_available(tool)


def test_under_ci_the_fixture_fails_instead_of_skipping(
    machine_without, tool, fixture_module, monkeypatch
):
    """CI runs as root: a missing requirement there is a broken CI image, not a reason to skip."""
    monkeypatch.setenv("CI", "true")
    machine_without("ip", "mount")
    with pytest.raises(pytest.fail.Exception, match=r"`mount` \(util-linux\) is not installed"):
        fixture_module.skip_unless_hosts_available(tool)


def test_nothing_is_missing_on_a_machine_that_has_everything(monkeypatch, tool):
    monkeypatch.setattr(tool.os, "geteuid", lambda: 0)
    monkeypatch.setattr(tool.shutil, "which", lambda c: f"/usr/bin/{c}")
    assert tool.missing_requirements() == []


def test_an_owner_is_alive_only_as_the_same_process(tool):
    """A pid reused by another process (another start time) is a dead owner."""
    me = os.getpid()
    start = tool.process_start(me)
    assert tool.RunState("r", 1, me, start).owner_alive()
    assert not tool.RunState("r", 1, me, start - 1).owner_alive()
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert not tool.RunState("r", 1, child.pid, start).owner_alive()


def test_a_machine_that_forbids_namespaces_is_refused_with_ips_error(monkeypatch, tool, tmp_path):
    """Root and every command present, but `ip netns add` fails (a container): refused with
    ip's message, and the state file written before it is removed again."""
    monkeypatch.setattr(tool, "require_hosts", lambda: None)

    def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        if args[:2] == ("netns", "add"):
            raise RuntimeError(f"ip {' '.join(args)}: mount --make-shared /run/netns failed")
        return subprocess.CompletedProcess(["ip", *args], 0, "", "")

    monkeypatch.setattr(tool, "ip", ip)
    hosts = tool.SimulatedHosts(2, state_dir=tmp_path)
    with pytest.raises(tool.HostsUnavailable, match="make-shared /run/netns failed"):
        hosts.up()
    assert list(tmp_path.iterdir()) == []
