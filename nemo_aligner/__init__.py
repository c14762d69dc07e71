"""nemo-aligner: align GPT models with SFT, reward models, PPO, DPO and SteerLM on megatron-core."""

__version__ = "0.1.0"
