"""Inspect AI sandbox provider `runner` (loaded through Inspect's `inspect_ai` entry point).

    @task
    def my_task():
        return Task(..., sandbox="runner")                      # compose.yaml / environment.yaml next to it
        return Task(..., sandbox=("runner", "environment.yaml"))  # runner Environment documents

The server is the node's `runner serve`: RUNNER_URL (or RUNNER_SOCKET) and RUNNER_TOKEN (or
RUNNER_TOKEN_FILE).
"""

from ._provider import RunnerSandboxEnvironment, RunnerSandboxEnvironmentConfig

__all__ = ["RunnerSandboxEnvironment", "RunnerSandboxEnvironmentConfig"]
