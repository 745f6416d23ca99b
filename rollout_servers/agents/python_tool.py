"""The `python` tool: runs the model's code in the sandbox and returns what it printed.

Declared as `class_name: python` in a tool config (`rollout_servers.agents.tools`); in a
server it runs in the server's one sandbox (`rollout.sandbox`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

from rollout_servers.agents.tools import Tool, ToolResponse, truncate_middle

if TYPE_CHECKING:
    from rollout_servers.sandbox import Sandbox


class CodeRunResult(Protocol):
    """What a sandbox run returns (`rollout_servers.sandbox.SandboxResult` has this shape)."""

    # Read-only properties, not attributes: a protocol attribute would have to accept any `str`
    # written to it, which `SandboxResult.status` (a Literal) does not.
    @property
    def status(self) -> str: ...  # "ok" | "error" | "timeout" | "oom" | "killed"
    @property
    def stdout(self) -> str: ...
    @property
    def stderr(self) -> str: ...
    @property
    def exit_code(self) -> int | None: ...
    @property
    def wall_s(self) -> float: ...


class CodeRunner(Protocol):
    """Runs untrusted code in isolation (`rollout_servers.sandbox.Sandbox`)."""

    async def run(self, code: str, stdin: str = "") -> CodeRunResult: ...


class PythonTool(Tool):
    """Runs `arguments["code"]` (with optional `arguments["stdin"]`) in the sandbox and returns
    the sandbox status, exit code, and stdout and stderr each cut to `max_output_chars`.

    In a server the sandbox is the server's one sandbox (`rollout.sandbox`, shared with the code
    reward), handed in by `load_tool_config`; standalone, the tool builds a default one (which
    probes its backend, a blocking sub-second check).
    """

    needs_sandbox = True

    def __init__(
        self,
        schema: Mapping[str, Any],
        max_output_chars: int = 2000,
        sandbox: CodeRunner | None = None,
    ):
        super().__init__(schema)
        if max_output_chars < 1:
            raise ValueError(f"max_output_chars must be >= 1, got {max_output_chars}")
        self.max_output_chars = max_output_chars
        self._owned: Sandbox | None = None
        if sandbox is None:
            from rollout_servers.sandbox import Sandbox, SandboxConfig

            sandbox = self._owned = Sandbox(SandboxConfig())
        self.sandbox = sandbox

    async def execute(self, instance_id: str, arguments: dict[str, Any]) -> ToolResponse:
        result = await self.sandbox.run(arguments["code"], arguments.get("stdin", ""))
        parts = [f"status: {result.status}, exit code: {result.exit_code}"]
        for label, stream in (("stdout", result.stdout), ("stderr", result.stderr)):
            if stream.rstrip("\n"):
                text = truncate_middle(stream.rstrip("\n"), self.max_output_chars)
                parts.append(f"{label}:\n{text}")
        metrics = {f"status_{result.status}": 1.0, "wall_s": float(result.wall_s)}
        peak_memory_mb = getattr(result, "peak_memory_mb", None)  # only the real sandbox has it
        if peak_memory_mb is not None:
            metrics["peak_memory_mb"] = float(peak_memory_mb)
        return ToolResponse("\n".join(parts), metrics=metrics)

    def close(self) -> None:
        if self._owned is not None:
            self._owned.close()
