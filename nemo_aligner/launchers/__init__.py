"""Launchers that start several jobs together (local PPO: critic server + actor)."""
