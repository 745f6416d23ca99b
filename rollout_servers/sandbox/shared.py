"""`SharedSandbox`: a rollout server's one sandbox, built once and handed to every user."""

from __future__ import annotations

from asyncrl.config.sandbox import SandboxConfig
from rollout_servers.sandbox.runner import Sandbox


class SharedSandbox:
    """The one `Sandbox` of a rollout server, shared by the python tool and the code reward:
    built by the first `get` (the server calls it at start-up when its tools or data need it,
    so a missing backend fails there), then reused; a failed build is remembered and raised
    again, naming what to install."""

    def __init__(self, config: SandboxConfig) -> None:
        self.config = config
        self._sandbox: Sandbox | None = None
        self._error: str | None = None

    def get(self) -> Sandbox:
        if self._sandbox is None:
            if self._error is not None:
                raise RuntimeError(self._error)
            try:
                self._sandbox = Sandbox(self.config)
            except RuntimeError as e:
                self._error = str(e)
                raise
        return self._sandbox

    def close(self) -> None:
        if self._sandbox is not None:
            self._sandbox.close()
