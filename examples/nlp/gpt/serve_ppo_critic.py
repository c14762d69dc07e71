"""PPO critic server with the reward model co-located (NeMo-Aligner's serve_ppo_critic.py).

    python examples/nlp/gpt/serve_ppo_critic.py pretrained_checkpoint.restore_from_path=rm.nemo \
        trainer.ppo.port=5556 exp_manager.explicit_log_dir=results/critic
"""

from nemo_aligner.recipes.ppo import serve_ppo_critic
from nemo_aligner.utils.hydra_runner import hydra_runner


@hydra_runner(config_path="conf", config_name="gpt_ppo_critic")
def main(cfg):
    serve_ppo_critic(cfg)


if __name__ == "__main__":
    main()
