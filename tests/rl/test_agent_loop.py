"""The agent loop: episode ends, tool errors, token bookkeeping through the real engine."""

from __future__ import annotations

import asyncio

import pytest

from rl.agent.executor import Executor, _ThreadHandle
from rl.agent.loop import LoopConfig, run_episode, run_episodes
from rl.agent.oracle import OraclePolicy
from rl.agent.policy import EnginePolicy, Sampling
from rl.envs.base import EnvContext, Environment, Grade, ToolError
from rl.tasks.schema import parse_task
from serving.chat import ChatRenderer
from serving.types import Message, TextPart, Tool

ECHO = Tool(
  "echo",
  "Repeats its text.",
  {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]},
)


class EchoEnv(Environment):
  """A math-domain test world with one tool; reward 1 iff the final text says 'done'."""

  domain = "math"

  def tools(self):
    return [ECHO]

  def _call(self, name, arguments):
    if arguments["text"] == "boom":
      raise ToolError("boom is not allowed; send other text")
    return arguments["text"].upper()

  def grade(self, final_text):
    if "crash" in final_text:
      raise ValueError("the grader cannot read this answer")
    return Grade(float("done" in final_text), "done" in final_text, {"seen": final_text})


class EchoExecutor(Executor):
  def __init__(self):
    import concurrent.futures

    self.pool = concurrent.futures.ThreadPoolExecutor(4)
    self.closed = 0

  async def open(self, task):
    env = EchoEnv(task, EnvContext())
    executor = self

    class Handle(_ThreadHandle):
      async def close(self):
        executor.closed += 1
        await super().close()

    return Handle(env, self.pool)


def _task(task_id="t0", **kw):
  return parse_task({"id": task_id, "domain": "math", "prompt": "say done", "answer": "done", **kw})


def _turn(content="", calls=(), thinking="hmm"):
  return {
    "thinking": thinking,
    "content": content,
    "tool_calls": [{"name": n, "arguments": a} for n, a in calls],
  }


def _play(task, turns, tier="low", **kw):
  policy = OraclePolicy({task.id: turns})
  executor = EchoExecutor()
  ep = asyncio.run(run_episode(task, policy, executor, tier=tier, sampling=Sampling(), **kw))
  assert executor.closed == 1  # the environment is always closed
  return ep


def test_tool_calls_results_and_answer():
  ep = _play(
    _task(),
    [
      _turn(calls=[("echo", {"text": "hi"}), ("echo", {"text": "boom"})]),
      _turn(calls=[("nope", {}), ("echo", {"wrong": 1})]),
      _turn("all <answer>done</answer>"),
    ],
  )
  assert ep.end == "answer" and ep.success and ep.reward == 1.0
  assert ep.tool_calls == 4 and ep.tool_errors == 3 and ep.num_turns == 3
  tool_texts = [m.content[0].text for m in ep.messages if m.role == "tool"]
  assert tool_texts[0] == "HI"
  assert "boom is not allowed" in tool_texts[1]
  assert "unknown tool 'nope'" in tool_texts[2] and "available tools: echo" in tool_texts[2]
  assert "bad arguments for echo" in tool_texts[3]
  assert [m.role for m in ep.messages] == [
    "user",
    "assistant",
    "tool",
    "tool",
    "assistant",
    "tool",
    "tool",
    "assistant",
  ]
  assert ep.messages[0].content[0].text == "say done"  # the prompt is never rewritten


def test_max_turns_and_system_prompt():
  task = _task(max_turns=2)
  ep = _play(task, [_turn(calls=[("echo", {"text": "a"})])] * 5, config=LoopConfig(system_prompt="be brief"))
  assert ep.end == "max_turns" and ep.num_turns == 2 and not ep.success
  assert ep.tool_calls == 1  # the last allowed turn's calls are not executed
  assert ep.messages[0].role == "system"


def test_policy_failure_ends_only_its_episode():
  class Failing(OraclePolicy):
    def session(self, task, *a):
      s = super().session(task, *a)
      if task.id == "bad":

        async def fail(messages, turn):
          raise ConnectionError("endpoint down")

        s.complete = fail
      return s

  tasks = [_task("good"), _task("bad")]
  policy = Failing({t.id: [_turn("<answer>done</answer>")] for t in tasks})
  eps = asyncio.run(run_episodes([(t, None, Sampling()) for t in tasks], policy, EchoExecutor()))
  assert eps[0].success and eps[0].end == "answer"
  assert eps[1].end == "error" and "endpoint down" in eps[1].error and not eps[1].success


def test_environment_failure_ends_only_its_episode(caplog):
  """An environment failing under a tool call (a Ray actor that died) ended the whole run before."""

  class Dying(EchoExecutor):
    async def open(self, task):
      handle = await super().open(task)
      if task.id == "dies":

        async def fail(*a):
          raise RuntimeError("the actor died unexpectedly")

        handle.execute = handle.close = fail
      return handle

  tasks = [_task("good"), _task("dies")]
  turns = [_turn(calls=[("echo", {"text": "hi"})]), _turn("<answer>done</answer>")]
  policy = OraclePolicy({t.id: turns for t in tasks})
  eps = asyncio.run(run_episodes([(t, None, Sampling()) for t in tasks], policy, Dying()))
  assert eps[0].success and eps[0].end == "answer" and eps[0].tool_calls == 1
  assert eps[1].end == "error" and "environment failed: RuntimeError: the actor died" in eps[1].error
  assert not eps[1].success and [m.role for m in eps[1].messages] == ["user", "assistant"]
  assert "closing the environment of task dies failed" in caplog.text


def test_an_environment_that_fails_to_open_or_start_ends_only_its_episode(caplog):
  """A failed open (no actor placed) or reset (a workspace or setup failure) ended the whole run;
  now the episode ends 'error', ungraded and unplayed (evaluation replays it, RL drops its group),
  and a started environment is still closed."""
  from rl.agent.episode import unplayed

  class Failing(EchoExecutor):
    async def open(self, task):
      if task.id == "no-open":
        raise ConnectionError("no actor could be placed")
      handle = await super().open(task)
      if task.id == "no-reset":

        async def fail():
          raise OSError("the workspace could not be made")

        handle.reset = fail
      return handle

  tasks = [_task("no-open"), _task("no-reset"), _task("good")]
  policy = OraclePolicy({t.id: [_turn("<answer>done</answer>")] for t in tasks})
  executor = Failing()
  eps = asyncio.run(run_episodes([(t, None, Sampling()) for t in tasks], policy, executor))
  assert [e.end for e in eps] == ["error", "error", "answer"]
  assert [unplayed(e) for e in eps] == [True, True, False]
  assert eps[0].error == "environment failed to open: ConnectionError: no actor could be placed"
  assert eps[1].error == "environment failed to start: OSError: the workspace could not be made"
  assert [(e.reward, e.success, e.grade, e.messages) for e in eps[:2]] == [(0.0, False, {}, [])] * 2
  assert eps[2].success and all(e.wall_s > 0 for e in eps)
  assert executor.closed == 2  # the reset that failed and the good one; nothing was opened for the first
  assert "opening its environment failed" in caplog.text and "resetting its environment failed" in caplog.text


def test_grader_failure_scores_only_its_episode_0(caplog):
  """An answer that crashed the grader (e.g. thousands of digits) ended the whole run before."""
  tasks = [_task("good"), _task("crashes")]
  turns = {"good": [_turn("<answer>done</answer>")], "crashes": [_turn("<answer>crash</answer>")]}
  eps = asyncio.run(run_episodes([(t, None, Sampling()) for t in tasks], OraclePolicy(turns), EchoExecutor()))
  assert eps[0].success and eps[0].reward == 1.0
  assert eps[1].reward == 0.0 and not eps[1].success and eps[1].grade["grader_failed"]
  assert "ValueError: the grader cannot read this answer" in eps[1].grade["error"]
  assert "grading task crashes failed" in caplog.text  # logged with its traceback


@pytest.fixture(scope="module")
def engine_policy(engine, serve_config):
  renderer = ChatRenderer(engine.tokenizer, num_image_tokens=0)
  return EnginePolicy(engine, renderer, dict(serve_config.serving.thinking_budgets))


def test_engine_session_is_append_only(engine_policy):
  """Turn t+1's prompt = turn t's prompt + its sampled tokens (thinking kept), then new tokens."""
  policy = engine_policy
  task = _task()
  first = [Message("user", [TextPart("say done")])]
  session = policy.session(
    task, first, [ECHO], "low", Sampling(temperature=1.0, seed=3, max_tokens_per_turn=24)
  )
  eot, end_think = policy.end_of_turn, policy.engine.tokenizer.special_id("/think")

  async def two_turns():
    prompt0 = list(session.ids)
    comp0 = await session.complete(first, 0)
    after0 = list(session.ids)
    messages = first + [comp0.message]
    # a random model rarely calls a tool; any appended message exercises the same path
    session.append(messages, [Message("user", [TextPart("RESULT: go on")])])
    prompt1 = list(session.ids)
    comp1 = await session.complete(messages, 1)
    return prompt0, comp0, after0, prompt1, comp1

  prompt0, comp0, after0, prompt1, comp1 = asyncio.run(two_turns())
  assert after0 == prompt0 + comp0.token_ids
  assert prompt1[: len(after0)] == after0  # earlier thinking and tokens are never dropped
  assert prompt1[len(after0) - 1] == eot or after0[-1] != eot
  n = len(session.ids)
  assert len(session.logprobs) == n and len(session.mask) == n
  assert session.ids[-len(comp1.token_ids) :] == comp1.token_ids
  # masks: 0 on prompts and tool results; 1 on sampled tokens; 0 on forced ones
  assert all(m == 0 for m in session.mask[: len(prompt0)])
  assert all(m == 0 for m in session.mask[len(after0) : len(prompt1)])
  gen0 = session.mask[len(prompt0) : len(after0)]
  for tok, m, forced, lp in zip(comp0.token_ids, gen0, comp0.forced, comp0.logprobs, strict=True):
    assert m == (0 if forced else 1)
    assert lp <= 0.0
    if forced:
      assert tok == end_think  # the thinking budget forced <|/think|>
  # tiny's 'low' budget is 8 thinking tokens and a random model rarely closes thinking itself
  assert comp0.thinking_tokens <= policy.budgets["low"]
  # At seed 3 it does not: the budget forced exactly one </think>, which stays out of the loss (the
  # loop above holds vacuously if forced tokens are never recorded).
  assert comp0.thinking_tokens == policy.budgets["low"] and comp0.forced.count(True) == 1, comp0.forced
  at = comp0.forced.index(True)
  assert comp0.token_ids[at] == end_think and session.mask[len(prompt0) + at] == 0


def test_engine_episodes_run_concurrently(engine_policy):
  tasks = [_task(f"t{i}") for i in range(6)]
  jobs = [
    (t, "low" if i % 2 else None, Sampling(temperature=1.0, seed=i, max_tokens_per_turn=12))
    for i, t in enumerate(tasks)
  ]
  eps = asyncio.run(run_episodes(jobs, engine_policy, EchoExecutor(), concurrency=4))
  for ep, (task, tier, _) in zip(eps, jobs, strict=True):
    assert ep.task_id == task.id and ep.tier == tier and ep.end in ("answer", "length", "max_turns")
    assert len(ep.token_ids) == len(ep.loss_mask) == len(ep.logprobs)
    assert sum(ep.loss_mask) >= 1 and ep.turns and ep.turns[0].prompt_start == 0
    for span in ep.turns:
      assert span.prompt_start <= span.gen_start <= span.gen_end <= len(ep.token_ids)
