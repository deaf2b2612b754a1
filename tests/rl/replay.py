"""Oracle replay shared by the domain tests: every oracle must score 1, every near miss 0."""

from rl.envs.base import replay
from rl.tasks.generators import corrupt_oracle, generate


def replay_scores(domain, level, ctx, n_train, n_heldout, seed):
  """Rewards of the oracle and of its corruption on tasks from both splits."""
  tasks = [*generate(domain, split="train", difficulty=level, n=n_train, seed=seed),
           *generate(domain, split="heldout", difficulty=level, n=n_heldout, seed=seed)]
  oracle = [replay(t, ctx).reward for t in tasks]
  corrupt = [replay(t, ctx, corrupt_oracle(t)).reward for t in tasks]
  return oracle, corrupt
