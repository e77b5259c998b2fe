"""GRPO reinforcement learning: losses, rewards and the trainer."""
