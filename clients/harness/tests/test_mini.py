"""The mini-swe-agent environment against runner serve: actions as mini's Docker environment
runs them, Submitted, and the session's removal."""

from __future__ import annotations

import pytest
from minisweagent.environments import get_environment
from minisweagent.exceptions import Submitted

from runner_harness import Server
from runner_harness.mini_swe_agent import RunnerEnvironment

from _support import PYTHON


def test_actions_timeouts_submission_and_cleanup(server: Server) -> None:
    env = get_environment(
        {"environment_class": "runner_harness.mini_swe_agent.RunnerEnvironment", "image": PYTHON, "cwd": "/repo", "env": {"A": "1"}, "timeout": 5},
    )
    assert isinstance(env, RunnerEnvironment)
    sid = env.session.id if env.session else ""
    try:
        out = env.execute({"command": "echo $A; echo err >&2; pwd; exit 2"})
        assert out == {"output": "1\nerr\n/repo\n", "returncode": 2, "exception_info": ""}
        out = env.execute({"command": "echo before; sleep 10"}, timeout=1)
        assert out["returncode"] == -1 and "timed out after 1 seconds" in out["exception_info"] and out["output"] == "before\n"
        assert env.execute({"command": "pwd"}, cwd="/tmp")["output"] == "/tmp\n"
        with pytest.raises(Submitted) as done:
            env.execute({"command": "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT; echo the patch"})
        assert done.value.messages[0]["extra"]["submission"] == "the patch\n"
        assert env.get_template_vars()["image"] == PYTHON
        assert env.serialize()["info"]["config"]["environment_type"] == "runner_harness.mini_swe_agent.RunnerEnvironment"
    finally:
        env.cleanup()
    with server.client() as c:
        assert sid not in [s.id for s in c.sessions.list()]
    env.cleanup()  # twice is fine
