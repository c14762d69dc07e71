"""Anthropic HH-RLHF to KTO jsonl (``{"prompt", "response", "preference"}``, chosen then rejected).

    python examples/nlp/data/kto/preprocess_anthropichh_data.py --input-dir hh-rlhf/helpful-base \\
        --output-dir data/kto      # -> train.jsonl, test.jsonl

NeMo-Aligner's script of this name downloads the data and keeps only the last exchange of each
conversation; this one reads the local files and keeps the whole history (NeMo's HH template).
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
    for split, _, out in hh_splits(args.input_dir):
        write(os.path.join(args.output_dir, f"{split}.jsonl"), out["kto"])


if __name__ == "__main__":
    run_cli(main)
