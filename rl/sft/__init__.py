"""Supervised warm start: conversations -> masked token examples -> packed batches."""
