"""Anthropic HH-RLHF in a chat template: reward-model comparisons and PPO prompts for Constitutional
AI's RL stage (NeMo-Aligner's command line; docs/cai.md).

    python examples/nlp/cai/process_anthropic_hh_using_chat_prompt.py --input-dir hh-rlhf \\
        --output-dir data/hh_helpful --dataset-dir-name helpful-base helpful-online helpful-rejection-sampled \\
        --output-file-name-prefix anthropic_helpful_only
    # -> anthropic_helpful_only_{train,test}_{prompts,comparisons,dpo}_with_chat_prompt.jsonl

``--input-dir`` is a local copy of the dataset (``git clone https://huggingface.co/datasets/Anthropic/hh-rlhf``):
one folder per subset holding ``train.jsonl.gz`` and ``test.jsonl.gz``. Without it the files are loaded
with Hugging Face ``datasets`` (as NeMo-Aligner does), which must be installed and online. No
``--dataset-dir-name``: the four subsets harmless-base, helpful-base, helpful-online and
helpful-rejection-sampled, output prefix ``anthropic_hh``.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cai_args import EXTRA_ID_TEMPLATE, add_template_args, template  # noqa: E402

SUBSETS = ("harmless-base", "helpful-base", "helpful-online", "helpful-rejection-sampled")


def subset_records(input_dir, names, split):
    """``(file, records)`` of ``split`` for each subset: from the local copy, else through ``datasets``."""
    from nemo_aligner.data.nlp.jsonl import read_jsonl
    from nemo_aligner.data.nlp.public_datasets import split_file

    if input_dir is not None:
        for name in names:
            path = split_file(os.path.join(input_dir, name), split)
            yield path, read_jsonl(path)
        return
    try:
        from datasets import load_dataset
    except ImportError:
        raise SystemExit("error: --input-dir is not set and Hugging Face datasets is not installed: pass "
                         "--input-dir <a local copy of Anthropic/hh-rlhf> (git clone "
                         "https://huggingface.co/datasets/Anthropic/hh-rlhf), or pip install datasets") from None
    for name in names:
        rows = load_dataset("Anthropic/hh-rlhf", data_dir=name, split=split)
        yield f"Anthropic/hh-rlhf/{name}/{split}", [dict(row, __line__=i + 1) for i, row in enumerate(rows)]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--input-dir", default=None, help="a local copy of Anthropic/hh-rlhf (one folder per subset)")
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--dataset-dir-name", nargs="*", default=None, help=f"subsets among {', '.join(SUBSETS)}")
    parser.add_argument("--output-file-name-prefix", default=None)
    parser.add_argument("--add-eos", choices=["False", "True"], default="True",
                        help="add --eos_token at the end of each comparison")
    add_template_args(parser, **EXTRA_ID_TEMPLATE)
    args = parser.parse_args(argv)

    from nemo_aligner.data.nlp.public_datasets import hh_to_chat_comparisons, write
    from nemo_aligner.recipes.cai import chat_prompt_path
    from nemo_aligner.utils.hydra_runner import run_cli

    def run():
        names = [n for n in (args.dataset_dir_name or []) if n]
        prefix = args.output_file_name_prefix
        if not names:
            names, prefix = list(SUBSETS), prefix or "anthropic_hh"
        unknown = [n for n in names if n not in SUBSETS]
        if unknown:
            raise SystemExit(f"error: --dataset-dir-name {unknown[0]!r} is not one of {', '.join(SUBSETS)}")
        if len(set(names)) != len(names):
            raise SystemExit("error: --dataset-dir-name names a subset twice")
        chat = template(args)
        add_eos = args.add_eos == "True"
        eos = (chat.eos_token or "") if add_eos else ""
        suffix = "" if add_eos else "_no_extra_id_eos"
        outputs = {}  # both splits read before anything is written
        for split in ("train", "test"):
            pairs, dropped = [], 0
            for path, records in subset_records(args.input_dir, names, split):
                some, n = hh_to_chat_comparisons(records, path, chat.format, eos)
                pairs += some
                dropped += n
            outputs[split] = pairs, dropped
        for split, (pairs, dropped) in outputs.items():
            name = lambda kind: chat_prompt_path(args.output_dir, prefix, split, kind, suffix)  # noqa: E731
            write(name("prompts"), [{"text": p["prompt"]} for p in pairs])
            write(name("comparisons"), [{"text": p[side]} for p in pairs for side in ("chosen", "rejected")])
            write(name("dpo"), [{"prompt": p["prompt"], "chosen_response": p["chosen"][len(p["prompt"]):],
                                 "rejected_response": p["rejected"][len(p["prompt"]):]} for p in pairs])
            if dropped:
                print(f"{split}: {dropped} pairs dropped (a turn empty or unanswered, or the two transcripts "
                      "differ before the last answer)")

    run_cli(run)


if __name__ == "__main__":
    main()
