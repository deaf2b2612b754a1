"""The evaluation harness: tasks x tiers x samples through any policy, resumable, reported."""
