"""Reinforcement learning pieces shared by both backends: prompts, sampled completions
scored into advantages (`rollouts`) and the rewards that score them (`rewards`)."""
