"""Joint multi-domain RL: objectives (GRPO family), task mixture, batches, the update, the loop."""
