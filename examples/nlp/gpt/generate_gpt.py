"""Generate from a .nemo; with steerlm.attributes, steer a SteerLM model.

    python examples/nlp/gpt/generate_gpt.py gpt_model_file=results/steerlm/checkpoints/megatron_gpt_steerlm.nemo \
        "prompts=['reverse abcd =']" "steerlm.attributes={quality: 4}" "inference.end_strings=['\n']"
"""

from nemo_aligner.recipes.generate import run_generate
from nemo_aligner.utils.hydra_runner import hydra_runner


@hydra_runner(config_path="conf", config_name="gpt_generate")
def main(cfg):
    return run_generate(cfg)


if __name__ == "__main__":
    main()
