"""Lightning-indexer scores with a running top-k (DSA key selection) as a Pallas kernel.

`ops.blockwise_topk` is a drop-in for model.attention.sparse.blockwise_topk;
`reference` holds the plain maths it is tested against; `kernel` the pallas_call.
"""

from pallas_kernels.indexer_topk.ops import BlockSizes, blockwise_topk

__all__ = ["BlockSizes", "blockwise_topk"]
