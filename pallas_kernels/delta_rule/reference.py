"""Reference maths of the gated delta rule kernels (Gated DeltaNet, Yang, Kautz & Hatamizadeh 2025).

The plain-JAX forms live with the model (model/attention/delta_rule.py) and are re-exported
here so the kernel sits beside the function it must reproduce:

  * `naive_gated_delta_rule`: a python loop over tokens, straight from the recurrence.
  * `recurrent_gated_delta_rule`: the same as a lax.scan (decode form).
  * `chunk_gated_delta_rule`: the chunkwise WY/UT form (XLA), which the Pallas kernel replaces
    as a drop-in (pallas_kernels/delta_rule/ops.py has the same signature and results).
"""

from model.attention.delta_rule import (
    chunk_gated_delta_rule,
    naive_gated_delta_rule,
    recurrent_gated_delta_rule,
)

__all__ = ["chunk_gated_delta_rule", "naive_gated_delta_rule", "recurrent_gated_delta_rule"]
