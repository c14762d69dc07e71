"""PPO actor job (NeMo-Aligner's train_gpt_ppo_actor.py); the critic server must be running.

    python examples/nlp/gpt/train_gpt_ppo_actor.py pretrained_checkpoint.restore_from_path=sft.nemo \
        "++model.data.data_prefix={train: [prompts.jsonl], validation: [val_prompts.jsonl], test: [val_prompts.jsonl]}" \
        remote_critic_rm.critic.ip=localhost remote_critic_rm.critic.port=5556 exp_manager.explicit_log_dir=results/actor
"""

from nemo_aligner.recipes.ppo import run_ppo_actor
from nemo_aligner.utils.hydra_runner import hydra_runner


@hydra_runner(config_path="conf", config_name="gpt_ppo_actor")
def main(cfg):
    return run_ppo_actor(cfg)


if __name__ == "__main__":
    main()
