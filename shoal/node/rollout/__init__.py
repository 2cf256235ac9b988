"""The rollout worker's engine: GRPO rounds between peers."""
