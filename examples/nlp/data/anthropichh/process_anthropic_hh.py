"""Anthropic HH-RLHF (its train/test files) to the reward-model, PPO and DPO formats.

    python examples/nlp/data/anthropichh/process_anthropic_hh.py --input-dir hh-rlhf/helpful-base \\
        --output-dir data/hh
    # -> {train,test}_comparisons.jsonl (train_reward_model.py), {train,test}_prompts.jsonl (PPO),
    #    {train,test}_dpo.jsonl (train_gpt_dpo.py)

The conversation is written in NeMo's HH template (``User: ...\\n\\nAssistant: ...``), the whole
history kept. Pairs whose transcripts differ before the last answer are skipped and counted.
"""

import argparse
import os

from nemo_aligner.data.nlp.public_datasets import hh_splits, write
from nemo_aligner.utils.hydra_runner import run_cli


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input-dir", required=True, help="holds train.jsonl(.gz) and test.jsonl(.gz)")
    parser.add_argument("--output-dir", default="./")
    args = parser.parse_args(argv)
    for split, path, out in hh_splits(args.input_dir):
        for kind in ("comparisons", "prompts", "dpo"):
            write(os.path.join(args.output_dir, f"{split}_{kind}.jsonl"), out[kind])
        if out["skipped"]:
            print(f"{path}: {len(out['skipped'])} pairs skipped (transcripts differ before the last answer; "
                  f"first: {out['skipped'][0]})")


if __name__ == "__main__":
    run_cli(main)
