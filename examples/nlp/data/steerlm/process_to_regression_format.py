"""SteerLM chat jsonl (labelled Assistant turns) to regression reward-model jsonl (``{"text", "label"}``).

    python examples/nlp/data/steerlm/process_to_regression_format.py --input-file data/hs2/train.jsonl \\
        --output-file data/hs2/train_reg.jsonl
    # then: train_reward_model.py model.reward_model_type=regression model.regression.num_attributes=9

Each labelled Assistant turn gives one line: the conversation up to it, rendered as
attribute_annotate.py scores it, and the label as a list in --attributes order (-100: absent).
"""

import argparse
import json

from nemo_aligner.data.nlp.jsonl import read_jsonl
from nemo_aligner.data.nlp.public_datasets import chat_to_regression, write
from nemo_aligner.data.nlp.steerlm_labels import NEMO_ATTRIBUTES
from nemo_aligner.utils.errors import ConfigError
from nemo_aligner.utils.hydra_runner import run_cli


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input-file", required=True)
    parser.add_argument("--output-file", required=True)
    parser.add_argument("--attributes", default=",".join(NEMO_ATTRIBUTES), help="label order (default: SteerLM's nine)")
    parser.add_argument("--chat-prompt-tokens", default=None,
                        help="JSON of model.data.chat_prompt_tokens the SFT model uses (default: NeMo's)")
    args = parser.parse_args(argv)
    tokens = None
    if args.chat_prompt_tokens:
        try:
            tokens = json.loads(args.chat_prompt_tokens)
        except json.JSONDecodeError as err:
            raise ConfigError(f"--chat-prompt-tokens is not JSON ({err.msg})") from None
    names = [a.strip() for a in args.attributes.split(",") if a.strip()]
    write(args.output_file, chat_to_regression(read_jsonl(args.input_file), args.input_file, tokens, names))


if __name__ == "__main__":
    run_cli(main)
