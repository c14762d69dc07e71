"""SPIN: self-play fine-tuning on SFT data (NeMo-Aligner's train_gpt_spin.py command line).

    python examples/nlp/gpt/train_gpt_spin.py pretrained_checkpoint.restore_from_path=sft.nemo \
        model.data.train_ds.file_path=sft_train.jsonl model.data.validation_ds.file_path=sft_val.jsonl \
        trainer.spin.max_iterations=3 "model.spin.ref_policy_kl_penalty=[0.1,0.2,0.4]" \
        exp_manager.explicit_log_dir=results/spin
"""

from nemo_aligner.recipes.spin import run_spin
from nemo_aligner.utils.hydra_runner import hydra_runner


@hydra_runner(config_path="conf", config_name="gpt_spin")
def main(cfg):
    return run_spin(cfg)


if __name__ == "__main__":
    main()
