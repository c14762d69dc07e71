"""PyTriton servers (reward model, PPO critic) and their clients."""
