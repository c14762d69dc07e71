"""Rejection sampling actor: sample several responses per prompt, keep the best by reward, train on
them with the SFT loss (NeMo-Aligner's train_gpt_rs_actor.py). Rewards from a reward-model server
(remote_rm) or a Python function (reward_fn).

    python examples/nlp/gpt/train_gpt_rs_actor.py pretrained_checkpoint.restore_from_path=sft.nemo \
        "model.data.data_prefix={train: [prompts_train.jsonl], validation: [prompts_val.jsonl]}" \
        remote_rm.reward_model.ip=localhost remote_rm.reward_model.port=5555 \
        model.rs.num_rollouts_per_prompt=8 model.rs.top_n_rollouts=1 exp_manager.explicit_log_dir=results/rs
"""

from nemo_aligner.recipes.rs import run_rs_actor
from nemo_aligner.utils.hydra_runner import hydra_runner


@hydra_runner(config_path="conf", config_name="gpt_rs_actor")
def main(cfg):
    return run_rs_actor(cfg)


if __name__ == "__main__":
    main()
