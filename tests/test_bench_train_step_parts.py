"""experiments/bench/train_step_parts.py: the parts it times cover every layer of the model, and each
part's timed function is the real backward of that part (every parameter and the input get a
non-zero, finite gradient), so the table's split of the step is of work the step does."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from configs import horizon
from experiments.bench import train_step_parts as parts
from model.config import ModelConfig
from model.decoder import Horizon


def test_parts_cover_the_layers_and_differentiate_their_parameters():
  cfg = ModelConfig.from_config(horizon.get_config("tiny").model)
  model = Horizon(cfg, rngs=nnx.Rngs(0))
  found = parts._parts(model, 2, 16)
  layers = {name: n for name, _, n, _, _ in found}
  assert layers["dsa attention"] + layers["delta attention"] == len(cfg.layer_kinds)
  assert layers.get("dense FFN", 0) + layers.get("moe FFN", 0) == len(cfg.ffn_kinds)
  assert layers["LM head + loss"] == 1
  # The parameters differentiated are the part's, its norm included (the step differentiates both).
  owners = {name: sorted({jax.tree_util.keystr(path[:1]) for path, _ in
                          jax.tree_util.tree_flatten_with_path(args[0])[0]}) for name, _, _, _, args in found}
  attn, ffn = ["['attn']", "['attn_norm']"], ["['ffn']", "['ffn_norm']"]
  assert owners == {"dsa attention": attn, "delta attention": attn, "dense FFN": ffn, "moe FFN": ffn,
                    "LM head + loss": ["['final_norm']", "['head']"]}
  for name, _, _, fn, args in found:
    g_params, g_x = fn(*args)
    assert g_x.shape == args[1].shape and np.isfinite(np.asarray(g_x, np.float32)).all(), name
    assert float(jnp.max(jnp.abs(g_x.astype(jnp.float32)))) > 0, name
    leaves = jax.tree.leaves(g_params)
    assert leaves and all(np.isfinite(np.asarray(g)).all() for g in leaves), name
    still = [jax.tree_util.keystr(k) for k, g in jax.tree_util.tree_flatten_with_path(g_params)[0]
             if float(jnp.max(jnp.abs(g))) == 0]
    assert not still, f"{name}: {still} get no gradient"
