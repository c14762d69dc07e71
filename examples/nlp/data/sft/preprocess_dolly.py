"""databricks-dolly-15k to SFT jsonl (``{"input", "output", "category"}``), as NeMo's Dolly preparation.

    python examples/nlp/data/sft/preprocess_dolly.py --input databricks-dolly-15k.jsonl
    # -> databricks-dolly-15k-output.jsonl; train with model.data.train_ds.file_path=<it>
"""

import argparse
import os

from nemo_aligner.data.nlp.jsonl import read_jsonl
from nemo_aligner.data.nlp.public_datasets import dolly_to_sft, write
from nemo_aligner.utils.hydra_runner import run_cli


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", required=True, help="the published databricks-dolly-15k.jsonl (a local copy)")
    parser.add_argument("--output", default=None, help="default: <input without .jsonl>-output.jsonl")
    parser.add_argument("--seed", type=int, default=1234, help="seeds the context-before/after-instruction coin")
    args = parser.parse_args(argv)
    output = args.output or os.path.splitext(args.input)[0] + "-output.jsonl"
    write(output, dolly_to_sft(read_jsonl(args.input), args.input, seed=args.seed))


if __name__ == "__main__":
    run_cli(main)
