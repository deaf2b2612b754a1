"""Pallas gated delta rule (Gated DeltaNet): chunkwise WY/UT forward and backward kernels.

`ops.chunk_gated_delta_rule` is a drop-in for model.attention.delta_rule.chunk_gated_delta_rule;
`reference` holds the argument checks and the plain per-token maths both are tested against;
`kernel` the pallas_calls. The names below load `ops` (and Pallas) on first use, so importing
`reference` alone stays Pallas-free.
"""

__all__ = ["BlockSizes", "chunk_gated_delta_rule"]


def __getattr__(name: str):
  if name in __all__:
    from pallas_kernels.delta_rule import ops  # noqa: PLC0415 - lazy: ops imports Pallas

    return getattr(ops, name)
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
