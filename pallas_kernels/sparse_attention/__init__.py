"""Top-k sparse MQA over the MLA latent (DSA main attention) as Pallas kernels.

`ops.sparse_mqa_attention` is a drop-in for model.attention.sparse.sparse_mqa_attention;
`reference` holds the plain maths it is tested against; `kernel` the pallas_calls.
"""

from pallas_kernels.sparse_attention.ops import BlockSizes, sparse_mqa_attention

__all__ = ["BlockSizes", "sparse_mqa_attention"]
