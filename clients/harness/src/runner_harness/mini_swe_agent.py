"""mini-swe-agent's environment on runner: every action runs in one runner session on the
node's `runner serve`, which is removed at `cleanup()` (or when the environment is garbage
collected, as mini's Docker environment does).

    environment:
      environment_class: runner_harness.mini_swe_agent.RunnerEnvironment
      image: local/python:3.11
      cwd: /testbed
      environment: {resources: {memory: 2Gi}}     # any runner Environment fields

Each action runs as mini's Docker environment runs it: `bash -lc COMMAND` (`interpreter`) in
`cwd` with `env` and the forwarded host variables, stdout and stderr together in order, a
timeout that kills the whole process tree, the output of `echo COMPLETE_TASK_AND_SUBMIT_
FINAL_OUTPUT` ending the run (Submitted). The server is RUNNER_URL / RUNNER_SOCKET with
RUNNER_TOKEN / RUNNER_TOKEN_FILE, or `url`, `socket`, `token_file` here.
"""

from __future__ import annotations

import atexit
import logging
import os
import platform
import weakref
from typing import Any, Dict, List, Optional

from pydantic import BaseModel

from runner_client import Client, NotFound, RunnerError, Session

from ._connect import server_from_env


class RunnerEnvironmentConfig(BaseModel):
    image: str
    """A runner image (`runner image ls`)."""
    cwd: str = "/"
    """Working directory of every action (made if missing)."""
    env: Dict[str, str] = {}
    forward_env: List[str] = []
    """Host variables given to every action when set here (`env` wins)."""
    timeout: int = 30
    """Seconds an action may run."""
    interpreter: List[str] = ["bash", "-lc"]
    environment: Dict[str, Any] = {}
    """More runner Environment fields: resources, network, egress, setup, user, ..."""
    url: Optional[str] = None
    socket: Optional[str] = None
    token_file: Optional[str] = None


def _submitted(output: Dict[str, Any]) -> None:
    """Raises Submitted when the action printed mini's completion marker (as its own
    environments decide it)."""
    from minisweagent.exceptions import Submitted

    lines = output.get("output", "").lstrip().splitlines(keepends=True)
    if lines and lines[0].strip() == "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT" and output["returncode"] == 0:
        submission = "".join(lines[1:])
        raise Submitted(
            {
                "role": "exit",
                "content": submission,
                "extra": {"exit_status": "Submitted", "submission": submission},
            }
        )


_live: "weakref.WeakSet[RunnerEnvironment]" = weakref.WeakSet()


@atexit.register
def _cleanup_at_exit() -> None:
    """mini's CLI never calls cleanup() and __del__ is not guaranteed at interpreter exit:
    sessions still open then are removed here."""
    for env in list(_live):
        env.cleanup()


class RunnerEnvironment:
    def __init__(
        self,
        *,
        config_class: type = RunnerEnvironmentConfig,
        logger: Optional[logging.Logger] = None,
        **kwargs: Any,
    ) -> None:
        self.logger = logger or logging.getLogger("minisweagent.environment")
        self.config = config_class(**kwargs)
        self.session: Optional[Session] = None
        server = server_from_env(self.config.url, socket=self.config.socket, token_file=self.config.token_file)
        self._client: Optional[Client] = server.client()
        try:
            self.session = self._client.session(self.environment_spec())
        except RunnerError as e:
            self._client.close()
            self._client = None
            raise RuntimeError("runner could not start the sandbox: %s" % e.message) from e
        _live.add(self)
        self.logger.info("Started runner session %s (%s)", self.session.id, self.config.image)

    def environment_spec(self) -> Dict[str, Any]:
        """The runner Environment of the session."""
        spec: Dict[str, Any] = {
            "image": self.config.image,
            "workdir": self.config.cwd or "/",
            # The image's files at the working directory stay visible, as with `docker run -w`.
            "mountWorkspace": False,
        }
        spec.update(self.config.environment)
        return spec

    def _env(self) -> Dict[str, str]:
        env = {k: v for k in self.config.forward_env if (v := os.getenv(k)) is not None}
        env.update(self.config.env)
        return env

    def execute(self, action: Dict[str, Any], cwd: str = "", *, timeout: Optional[int] = None) -> Dict[str, Any]:
        """Run the action's command; its output (stdout and stderr in order) and exit code."""
        command = action.get("command", "")
        assert self.session is not None, "the runner session was removed (cleanup)"
        seconds = timeout or self.config.timeout
        # One stream, in the order written: stderr joins stdout in the sandbox.
        argv = ["/bin/sh", "-c", 'exec "$@" 2>&1', "runner-action", *self.config.interpreter, command]
        try:
            result = self.session.exec(argv, cwd=cwd or self.config.cwd, env=self._env() or None, timeout=seconds)
            if result.timed_out:
                # What mini's own environments report for a command that ran out of time.
                output: Dict[str, Any] = {
                    "output": result.stdout,
                    "returncode": -1,
                    "exception_info": "An error occurred while executing the command: Command '%s' timed out after %s seconds"
                    % (command, seconds),
                    "extra": {"exception_type": "TimeoutExpired", "exception": "timed out after %s seconds" % seconds},
                }
            else:
                code = result.exit_code if result.exit_code is not None else 128 + (result.signal or 0)
                output = {"output": result.stdout, "returncode": code, "exception_info": ""}
        except RunnerError as e:
            output = {
                "output": "",
                "returncode": -1,
                "exception_info": "An error occurred while executing the command: %s" % e,
                "extra": {"exception_type": type(e).__name__, "exception": str(e)},
            }
        _submitted(output)
        return output

    def get_template_vars(self, **kwargs: Any) -> Dict[str, Any]:
        from minisweagent.utils.serialize import recursive_merge

        data: Dict[str, Any] = recursive_merge(self.config.model_dump(), platform.uname()._asdict(), kwargs)
        return data

    def serialize(self) -> Dict[str, Any]:
        return {
            "info": {
                "config": {
                    "environment": self.config.model_dump(mode="json"),
                    "environment_type": "%s.%s" % (self.__class__.__module__, self.__class__.__name__),
                }
            }
        }

    def cleanup(self) -> None:
        """Remove the session (its container and everything in it)."""
        session, self.session = getattr(self, "session", None), None
        client, self._client = getattr(self, "_client", None), None
        try:
            if session is not None:
                try:
                    session.delete()
                except NotFound:
                    pass
                except RunnerError as e:
                    self.logger.warning("removing runner session %s: %s", session.id, e)
        finally:
            if client is not None:
                client.close()

    def __del__(self) -> None:
        self.cleanup()
