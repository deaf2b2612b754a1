"""MXFP4 (OCP MX v1.0) weights: format, reference matmuls and Pallas kernels.

format.py: quantize / dequantize in the gpt-oss layout; ops.py: mxfp4_matmul,
mxfp4_ragged_matmul (Pallas, gradient w.r.t. x); reference.py: the same maths
with dense dequantized weights and XLA matmuls.
"""

from pallas_kernels.mxfp4.format import (
    DEFAULT_MODE,
    MODES,
    decode_e2m1_scaled,
    dequantize,
    e2m1_to_float,
    float_to_e2m1,
    mxfp4_nbytes,
    pack_e2m1,
    quantize,
    unpack_e2m1,
)
from pallas_kernels.mxfp4.ops import BlockSizes, mxfp4_matmul, mxfp4_ragged_matmul
from pallas_kernels.mxfp4.reference import mxfp4_matmul_reference, mxfp4_ragged_matmul_reference

__all__ = [
    "DEFAULT_MODE", "MODES", "BlockSizes", "decode_e2m1_scaled", "dequantize", "e2m1_to_float",
    "float_to_e2m1", "mxfp4_matmul", "mxfp4_matmul_reference", "mxfp4_nbytes",
    "mxfp4_ragged_matmul", "mxfp4_ragged_matmul_reference", "pack_e2m1", "quantize", "unpack_e2m1",
]
