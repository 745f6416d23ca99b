"""The `simulated_hosts` fixture: simulated hosts (tools/hosts.py) for the tests of asyncrl across
hosts. A test module takes it with `pytest_plugins = ["simulated_hosts"]`; `hosts_tool` is the tool's
module.

Function scoped, as a factory: `simulated_hosts(n, **kwargs)` brings up a run of N hosts
(keyword arguments as `SimulatedHosts` takes them) and every run a test made is torn down after
it, passed or failed; a run left by a SIGKILLed pytest is swept by the next one (its owner, the
pytest process, is dead). Bringing hosts up costs about 0.2 s, so each test gets fresh ones and
no fault of one test (a cut link, a killed process) reaches the next.

Without root, iproute2 or util-linux, the test is skipped with the reason tools/hosts.py gives.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

TOOL = Path(__file__).resolve().parents[2] / "tools" / "hosts.py"


def load_hosts_tool() -> ModuleType:
    """tools/hosts.py as the module `asyncrl_hosts_tool` (tools/ is not a package)."""
    name = "asyncrl_hosts_tool"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, TOOL)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up by name
        spec.loader.exec_module(module)
    return sys.modules[name]


def unavailable(reason: str) -> None:
    """Skips the test, naming why simulated hosts cannot be made; under CI (`CI` set), which runs
    as root with iproute2 and util-linux, fails it instead, so the tests cannot vanish there."""
    if os.environ.get("CI"):
        pytest.fail(reason + " (CI runs as root: simulated hosts must work there)")
    pytest.skip(reason)


def skip_unless_hosts_available(tool: ModuleType) -> None:
    """Skips the test, with tools/hosts.py's reasons, where simulated hosts cannot be made."""
    reasons = tool.missing_requirements()
    if reasons:
        unavailable("simulated hosts are unavailable: " + "; ".join(reasons))


@pytest.fixture
def hosts_tool() -> ModuleType:
    """tools/hosts.py, imported (its `SimulatedHosts`, `sweep`, `list_namespaces`...); the test
    is skipped where simulated hosts cannot be made."""
    tool = load_hosts_tool()
    skip_unless_hosts_available(tool)
    return tool


@pytest.fixture
def simulated_hosts(hosts_tool: ModuleType) -> Iterator[Callable[..., Any]]:
    """`simulated_hosts(n, **kwargs)`: a run of N hosts, up; all torn down after the test."""
    tool = hosts_tool
    tool.sweep()
    made = []

    def make(n: int, **kwargs: Any) -> Any:
        hosts = tool.SimulatedHosts(n, **kwargs)
        made.append(hosts)
        try:
            return hosts.up()
        except tool.HostsUnavailable as e:  # e.g. a container that forbids namespaces
            unavailable(str(e))

    yield make
    failures = []
    for hosts in made:  # every run is torn down, even when another's tear-down fails
        try:
            hosts.down()
        except Exception as e:
            failures.append(e)
    if failures:
        raise failures[0]
