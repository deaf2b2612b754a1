"""Pallas gated delta rule (Gated DeltaNet): chunkwise WY/UT forward and backward kernels."""

from pallas_kernels.delta_rule.ops import BlockSizes, chunk_gated_delta_rule

__all__ = ["BlockSizes", "chunk_gated_delta_rule"]
