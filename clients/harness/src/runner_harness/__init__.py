"""runner as a native sandbox of the harnesses people evaluate with.

- Inspect AI: `sandbox="runner"` or `sandbox=("runner", "compose.yaml" | "environment.yaml")`
  (registered through Inspect's entry point when this package is installed);
- Harbor: `harbor run --env runner_harness.harbor:RunnerEnvironment ...`;
- mini-swe-agent: `environment_class: runner_harness.mini_swe_agent.RunnerEnvironment`.

Each starts its sandboxes on the node's `runner serve` (RUNNER_URL or RUNNER_SOCKET, and
RUNNER_TOKEN or RUNNER_TOKEN_FILE) and removes them when the harness is done with them.
`Sandbox` is what they share: one runner session seen as `docker exec` sees a container.
"""

from ._connect import ConnectionSettingsError, Server, server_from_env
from .sandbox import FileTooLarge, Sandbox, SandboxError, SandboxGone, UserSwitchUnsupported

__version__ = "0.1.0"

__all__ = [
    "ConnectionSettingsError",
    "FileTooLarge",
    "Sandbox",
    "SandboxError",
    "SandboxGone",
    "Server",
    "UserSwitchUnsupported",
    "server_from_env",
]
