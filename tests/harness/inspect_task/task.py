"""The Inspect task of tests/harness/run.sh: Inspect's offline mockllm/model answers each
sample with Python code (one right, one wrong); the scorer runs that code in the sandbox and
compares its output with the target. `-T hang=true`: the one sample sleeps in its sandbox,
for the interruption test."""

from inspect_ai import Task, task
from inspect_ai.dataset import Sample
from inspect_ai.model import ModelOutput, ModelUsage, get_model
from inspect_ai.scorer import CORRECT, INCORRECT, Score, Target, accuracy, scorer
from inspect_ai.solver import Generate, TaskState, generate, solver
from inspect_ai.util import sandbox

ANSWERS = {"add": "print(6 * 7)", "off-by-one": "print(6 * 7 - 1)"}


def mock_answer(messages, tools, tool_choice, config) -> ModelOutput:
    prompt = messages[-1].text
    out = ModelOutput.from_content(model="mockllm/model", content=ANSWERS[prompt])
    # Usage given: mockllm would count tokens with tiktoken, which fetches its vocabulary.
    out.usage = ModelUsage(input_tokens=1, output_tokens=1, total_tokens=2)
    return out


@solver
def check_sandboxes(hang: bool = False):
    async def solve(state: TaskState, generate: Generate) -> TaskState:
        aux = sandbox("aux")
        ran = await aux.exec(["cat", "/tmp/main-ran"])
        assert ran.stdout == "started\n", ran
        env = await sandbox().exec(["sh", "-c", "pwd; echo $GREETING"])
        assert env.stdout == "/work\nhello from compose\n", env
        # Long enough for the test's watcher to read the sandbox's spec while it lives.
        await sandbox().exec(["sleep", "600" if hang else "1"])
        return state

    return solve


@scorer(metrics=[accuracy()])
def runs_in_sandbox():
    async def score(state: TaskState, target: Target) -> Score:
        await sandbox().write_file("answer.py", state.output.completion)
        result = await sandbox().exec(["python3", "answer.py"], timeout=60)
        value = CORRECT if result.success and result.stdout.strip() == target.text else INCORRECT
        return Score(value=value, answer=result.stdout.strip(), explanation=result.stderr)

    return score


@task
def arithmetic(hang: bool = False):
    samples = [Sample(id="add", input="add", target="42"), Sample(id="off-by-one", input="off-by-one", target="42")]
    return Task(
        dataset=samples[:1] if hang else samples,
        solver=[check_sandboxes(hang), generate()],
        scorer=runs_in_sandbox(),
        sandbox="runner",
        model=get_model("mockllm/model", custom_outputs=mock_answer),
    )
