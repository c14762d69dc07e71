"""Supervised fine-tuning of a GPT model (NeMo-Aligner's train_gpt_sft.py command line).

    python examples/nlp/gpt/train_gpt_sft.py model.data.train_ds.file_path=train.jsonl \
        model.data.validation_ds.file_path=val.jsonl exp_manager.explicit_log_dir=results
    torchrun --nproc_per_node 2 examples/nlp/gpt/train_gpt_sft.py trainer.devices=2 \
        model.tensor_model_parallel_size=2 ...
"""

from nemo_aligner.recipes.sft import run_sft
from nemo_aligner.utils.hydra_runner import hydra_runner


@hydra_runner(config_path="conf", config_name="gpt_sft")
def main(cfg):
    return run_sft(cfg)


if __name__ == "__main__":
    main()
