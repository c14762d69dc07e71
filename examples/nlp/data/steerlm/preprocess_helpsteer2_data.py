"""HelpSteer2 to SteerLM chat jsonl, as NeMo-Aligner's script of this name.

    python examples/nlp/data/steerlm/preprocess_helpsteer2_data.py --input-dir HelpSteer2 -dir data/hs2
    python ... -oh        # label helpfulness only
    python ... -pref      # the preference subset (preference.jsonl): each response labelled quality:<strength>
"""

import argparse
import os

from nemo_aligner.data.nlp.jsonl import read_jsonl
from nemo_aligner.data.nlp.public_datasets import (helpsteer2_preference_to_steerlm, helpsteer_to_steerlm,
                                                   split_file, write)
from nemo_aligner.utils.hydra_runner import run_cli


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-dir", "--output_directory", required=True)
    parser.add_argument("--input-dir", required=True, help="holds train/validation.jsonl(.gz), or "
                                                           "preference.jsonl(.gz) with -pref (nothing is downloaded)")
    parser.add_argument("-oh", "--only_helpfulness", action="store_true")
    parser.add_argument("-pref", "--preference", action="store_true")
    args = parser.parse_args(argv)
    if args.preference:
        path = split_file(args.input_dir, "preference")
        train, val = helpsteer2_preference_to_steerlm(read_jsonl(path), path)
        write(os.path.join(args.output_directory, "train.jsonl"), train)
        write(os.path.join(args.output_directory, "val.jsonl"), val)
        return
    for split, name in (("train", "train"), ("validation", "val")):
        path = split_file(args.input_dir, split)
        write(os.path.join(args.output_directory, f"{name}.jsonl"),
              helpsteer_to_steerlm(read_jsonl(path), path, only_helpfulness=args.only_helpfulness))


if __name__ == "__main__":
    run_cli(main)
