"""Convert a .nemo to a Hugging Face directory that transformers loads (Llama, Mistral, Mixtral,
Gemma, Qwen2 or GPT-2 layout), with its tokenizer.

    python examples/nlp/gpt/convert_nemo_to_hf.py --input-file model.nemo --output-dir hf_model [--precision bf16]

NeMo's ``convert_*_nemo_to_hf.py`` command lines work too:

    python examples/nlp/gpt/convert_nemo_to_hf.py --input_name_or_path model.nemo \\
        --output_path hf_model/pytorch_model.bin [--hf_input_path base_hf --hf_output_path hf_model] \\
        [--hf_output_tokenizer tokenizer_dir] [--precision bf16] [--cpu-only]

``--output_path`` ending in ``.bin`` (``.pt``, ``.pth``) is a weights file (one torch state dict in
Hugging Face's names, as the Llama/Qwen2/Nemotron scripts write); with ``--hf_output_path`` the whole
directory is written there as well. Any other ``--output_path`` is the directory itself, as the
Mistral and Mixtral scripts write it. The config comes from the
.nemo, so ``--hf_input_path`` (whose config.json NeMo's scripts read) is not needed; the .nemo's own
tokenizer is written, so ``--input_tokenizer`` is not needed either (each gets a warning if given).
``--precision`` defaults to the .nemo's ``precision``, as in NeMo's scripts.
"""

import argparse
import logging
import os
import shutil

from nemo_aligner.utils.hydra_runner import run_cli

logger = logging.getLogger("convert_nemo_to_hf")
WEIGHTS_SUFFIXES = (".bin", ".pt", ".pth")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--input-file", "--input_name_or_path", dest="input_file", required=True,
                        help="a .nemo file or extracted directory (any TP/PP it was saved at)")
    parser.add_argument("--output-dir", "--hf_output_path", dest="output_dir",
                        help="the Hugging Face directory to write")
    parser.add_argument("--output_path", dest="weights_file",
                        help="NeMo's: the weights as one torch state dict (pytorch_model.bin)")
    parser.add_argument("--precision", help="32, bf16 or 16 (NeMo's spellings too); default: the .nemo's")
    parser.add_argument("--hf_output_tokenizer", help="also write the tokenizer files here")
    parser.add_argument("--hf_input_path", help="NeMo's: not read (the config comes from the .nemo)")
    parser.add_argument("--hf_model_name", help="NeMo's Mistral/Mixtral scripts': not read (the config comes from "
                        "the .nemo)")
    parser.add_argument("--input_tokenizer", help="NeMo's: not read (the .nemo's own tokenizer is written)")
    parser.add_argument("--cpu-only", "--cpu_only", action="store_true", help="NeMo's: the conversion runs on the CPU")
    args = parser.parse_args(argv)
    if args.weights_file and not args.weights_file.endswith(WEIGHTS_SUFFIXES):  # the Mistral/Mixtral scripts' form
        if args.output_dir is not None:
            parser.error(f"--output_path {args.weights_file} is a directory (no {'/'.join(WEIGHTS_SUFFIXES)} "
                         "suffix) and so is --hf_output_path/--output-dir: give one")
        args.output_dir, args.weights_file = args.weights_file, None
    if args.output_dir is None and args.weights_file is None:
        parser.error("give --output-dir (or NeMo's --hf_output_path), --output_path, or both")
    if args.hf_output_tokenizer and args.output_dir is None:
        parser.error("--hf_output_tokenizer needs --output-dir or --hf_output_path (the tokenizer is written with "
                     "the directory)")
    for key in ("hf_input_path", "hf_model_name", "input_tokenizer"):
        if getattr(args, key):
            logger.warning("--%s=%s is not read: %s", key, getattr(args, key),
                           "the .nemo's own tokenizer is written" if key == "input_tokenizer"
                           else "the config comes from the .nemo")
    from nemo_aligner.models.nlp.gpt.hf_interop import export_to_hf

    # precision None: the .nemo's own, as NeMo's scripts default
    written = export_to_hf(args.input_file, args.output_dir, precision=args.precision, weights_file=args.weights_file)
    if args.hf_output_tokenizer and os.path.abspath(args.hf_output_tokenizer) != os.path.abspath(args.output_dir):
        from nemo_aligner.utils.tokenizers.hf_export import TOKENIZER_FILE_NAMES

        os.makedirs(args.hf_output_tokenizer, exist_ok=True)
        for name in TOKENIZER_FILE_NAMES:
            if os.path.isfile(os.path.join(args.output_dir, name)):
                shutil.copy(os.path.join(args.output_dir, name), os.path.join(args.hf_output_tokenizer, name))
    if args.weights_file:
        print(f"weights written to {args.weights_file}", flush=True)
    if args.output_dir:
        print(f"Hugging Face model written to {written}", flush=True)


if __name__ == "__main__":
    run_cli(main)
