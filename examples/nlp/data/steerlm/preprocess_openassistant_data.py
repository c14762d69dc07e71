"""OpenAssistant oasst1 message trees to SteerLM chat jsonl, as NeMo-Aligner's script of this name.

    python examples/nlp/data/steerlm/preprocess_openassistant_data.py -dir data/oasst
    # reads data/oasst/2023-04-12_oasst_all.trees.jsonl.gz (the published file; nothing is downloaded)
    # -> data/oasst/train.jsonl, val.jsonl (95/5 by tree, seeded)
"""

import argparse
import os

from nemo_aligner.data.nlp.jsonl import read_jsonl
from nemo_aligner.data.nlp.public_datasets import oasst_to_steerlm, write
from nemo_aligner.utils.errors import DataError
from nemo_aligner.utils.hydra_runner import run_cli

TREES = "2023-04-12_oasst_all.trees.jsonl.gz"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-dir", "--output_directory", required=True)
    parser.add_argument("--input-file", default=None, help=f"the trees file (default: <output_directory>/{TREES})")
    args = parser.parse_args(argv)
    path = args.input_file or os.path.join(args.output_directory, TREES)
    if not os.path.isfile(path):
        raise DataError(f"{path}: no such file; save OpenAssistant's {TREES} there (nothing is downloaded)")
    train, val = oasst_to_steerlm(read_jsonl(path), path)
    write(os.path.join(args.output_directory, "train.jsonl"), train)
    write(os.path.join(args.output_directory, "val.jsonl"), val)


if __name__ == "__main__":
    run_cli(main)
