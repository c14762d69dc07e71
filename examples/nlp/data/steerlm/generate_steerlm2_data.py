"""SteerLM 2.0 training records: responses sampled by a SteerLM model for each prompt and attribute
string, with log Q(y|a,x), log P(y|x) (an SFT model) and log P(a|x,y) (a regression reward model).

    python examples/nlp/data/steerlm/generate_steerlm2_data.py --input-file prompts.jsonl \
        --labels "quality:4;quality:2;quality:0" --steerlm-model steerlm.nemo --sft-model sft.nemo \
        --reward-model rm_regression.nemo --num-responses 4 --output-file steerlm2_train.jsonl
"""

from nemo_aligner.recipes.steerlm2_data import main
from nemo_aligner.utils.hydra_runner import run_cli

if __name__ == "__main__":
    run_cli(main)
