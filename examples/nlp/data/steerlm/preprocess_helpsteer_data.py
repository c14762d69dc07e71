"""HelpSteer (its train/validation files) to SteerLM chat jsonl, as NeMo-Aligner's script of this name.

    python examples/nlp/data/steerlm/preprocess_helpsteer_data.py --input-dir HelpSteer -dir data/helpsteer
    # -> data/helpsteer/train.jsonl, val.jsonl; Assistant turns labelled "helpfulness:3,correctness:4,..."
"""

import argparse
import os

from nemo_aligner.data.nlp.jsonl import read_jsonl
from nemo_aligner.data.nlp.public_datasets import helpsteer_to_steerlm, split_file, write
from nemo_aligner.utils.hydra_runner import run_cli


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-dir", "--output_directory", required=True)
    parser.add_argument("--input-dir", required=True, help="holds train.jsonl(.gz) and validation.jsonl(.gz) "
                                                           "(the published splits; nothing is downloaded)")
    args = parser.parse_args(argv)
    for split, name in (("train", "train"), ("validation", "val")):
        path = split_file(args.input_dir, split)
        write(os.path.join(args.output_directory, f"{name}.jsonl"), helpsteer_to_steerlm(read_jsonl(path), path))


if __name__ == "__main__":
    run_cli(main)
