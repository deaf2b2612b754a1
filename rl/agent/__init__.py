"""The multi-turn agent loop shared by RL rollouts, SFT data generation and evaluation."""
