"""Top-k sparse MQA over the MLA latent (DSA main attention) as Pallas kernels.

`ops.sparse_mqa_attention` is a drop-in for model.attention.sparse.sparse_mqa_attention;
`reference` holds the argument checks and the plain maths both are tested
against; `kernel` the pallas_calls. The names below load `ops` (and Pallas) on
first use, so importing `reference` alone stays Pallas-free.
"""

__all__ = ["BlockSizes", "sparse_mqa_attention"]


def __getattr__(name: str):
  if name in __all__:
    from pallas_kernels.sparse_attention import ops  # noqa: PLC0415 - lazy: ops imports Pallas

    return getattr(ops, name)
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
