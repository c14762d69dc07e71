"""Remove the chat records that would train on nothing: those left without a trained token once cut
to the training sequence length (and records that are not valid chat records), as NeMo-Aligner's
script of the same name does before SFT.

    python examples/nlp/data/sft/remove_long_dialogues.py --tokenizer_path tokenizer.model \\
        --tokenizer_type sentencepiece --dataset_file chat.jsonl --output_file chat_fits.jsonl --seq_len 4096

``--tokenizer_path``: a SentencePiece model, a Hugging Face tokenizer directory or name
(``--tokenizer_type huggingface``), or a .nemo whose tokenizer to use. Records are rendered in NeMo's
chat format (``<extra_id_*>`` turns) and cut as ``model.data.chat=True`` training cuts them. Each
written record keeps ``system``, ``mask``, ``conversations``, ``type`` and ``dataset``; every turn gets
``label`` (null) and ``canoncial_form`` ("") when it has none, as in NeMo-Aligner's output.
"""

import argparse

KEPT_FIELDS = ("system", "mask", "conversations", "dataset", "type")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokenizer_path", required=True)
    parser.add_argument("--tokenizer_type", default=None, choices=["sentencepiece", "huggingface"],
                        help="default: sentencepiece for a .model file, else huggingface")
    parser.add_argument("--dataset_file", required=True)
    parser.add_argument("--output_file", required=True)
    parser.add_argument("--seq_len", type=int, default=4096)
    args = parser.parse_args(argv)

    from nemo_aligner.data.nlp.jsonl import read_jsonl, write_jsonl
    from nemo_aligner.data.nlp.sft_dataset import chat_records_with_loss
    from nemo_aligner.utils.errors import ConfigError, DataError
    from nemo_aligner.utils.hydra_runner import run_cli
    from nemo_aligner.utils.nemo_file import tokenizer_from_path

    def run():
        if args.seq_len < 2:
            raise ConfigError(f"--seq_len={args.seq_len} must be at least 2")
        tokenizer = tokenizer_from_path(args.tokenizer_path, args.tokenizer_type, "--tokenizer_path", "--tokenizer_type")
        records = read_jsonl(args.dataset_file)
        kept, dropped = chat_records_with_loss(records, args.dataset_file, tokenizer, args.seq_len)
        if records and not kept:
            raise DataError(f"{args.dataset_file}: every one of its {len(records)} records would train on nothing "
                            f"at --seq_len={args.seq_len} (first: {dropped[0]}); nothing written")
        out = []
        for record in kept:
            record = {k: record[k] for k in KEPT_FIELDS if k in record}
            record["conversations"] = [{**turn, "canoncial_form": turn.get("canoncial_form", ""),
                                        "label": turn.get("label")} for turn in record["conversations"]]
            out.append(record)
        write_jsonl(args.output_file, out)
        share = 100.0 * len(dropped) / max(len(records), 1)
        print(f"removed {len(dropped)}/{len(records)} records ({share:.2f}%); {len(out)} -> {args.output_file}")
        for line in dropped[:10]:
            print(f"  {line}")
        if len(dropped) > 10:
            print(f"  ... and {len(dropped) - 10} more")

    run_cli(run)


if __name__ == "__main__":
    main()
