"""Merge LoRA adapters (an adapters-only .nemo) into their base model's weights, with the command line of
NeMo's ``scripts/nlp_language_modeling/merge_lora_weights/merge.py``:

    python examples/nlp/gpt/merge_lora_weights.py gpt_model_file=base.nemo \
        lora_model_path=megatron_gpt_dpo.nemo merged_model_path=merged.nemo trainer.precision=bf16
"""

from nemo_aligner.recipes.merge_lora_weights import run_merge_lora_weights
from nemo_aligner.utils.hydra_runner import hydra_runner


@hydra_runner(config_path="conf", config_name="merge_lora_weights")
def main(cfg):
    return run_merge_lora_weights(cfg)


if __name__ == "__main__":
    main()
