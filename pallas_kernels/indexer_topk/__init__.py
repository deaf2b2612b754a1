"""Lightning-indexer scores with a running top-k (DSA key selection) as a Pallas kernel.

`ops.blockwise_topk` is a drop-in for model.attention.sparse.blockwise_topk;
`reference` holds the argument checks and the plain maths both are tested
against; `kernel` the pallas_call. The names below load `ops` (and Pallas) on
first use, so importing `reference` alone stays Pallas-free.
"""

__all__ = ["BlockSizes", "blockwise_topk"]


def __getattr__(name: str):
  if name in __all__:
    from pallas_kernels.indexer_topk import ops  # noqa: PLC0415 - lazy: ops imports Pallas

    return getattr(ops, name)
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
