"""Shared by the domain tests: oracle replay (every oracle must score 1, every near miss 0) and the
sandboxed context the command-running domains need."""

from rl.envs.base import EnvContext, replay
from rl.sandbox import Sandbox, SandboxUnavailable
from rl.tasks.generators import corrupt_oracle, generate
from tests.helpers import isolation_unavailable


def replay_scores(domain, level, ctx, n_train, n_heldout, seed):
  """Rewards of the oracle and of its corruption on tasks from both splits."""
  tasks = [*generate(domain, split="train", difficulty=level, n=n_train, seed=seed),
           *generate(domain, split="heldout", difficulty=level, n=n_heldout, seed=seed)]
  oracle = [replay(t, ctx).reward for t in tasks]
  corrupt = [replay(t, ctx, corrupt_oracle(t)).reward for t in tasks]
  return oracle, corrupt


def sandboxed_context(tmp_path_factory, name: str, **kw) -> EnvContext:
  """An EnvContext under a fresh temporary root; skips the test where nsjail cannot run."""
  try:
    Sandbox()
  except SandboxUnavailable as e:
    isolation_unavailable(f"nsjail cannot run here: {e}")
  return EnvContext(root=tmp_path_factory.mktemp(name), **kw)
