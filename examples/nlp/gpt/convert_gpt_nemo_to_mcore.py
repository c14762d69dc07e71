"""Re-write a .nemo with NeMo's pre-megatron-core weight names (or any .nemo this project reads) as a
megatron-core .nemo, as NeMo's ``scripts/checkpoint_converters/convert_gpt_nemo_to_mcore.py`` does, with
its command line:

    python examples/nlp/gpt/convert_gpt_nemo_to_mcore.py --input-name-or-path model_checkpoint \\
        --output-path mcore_gpt.nemo

The input is a .nemo file or an extracted one (a directory), at any TP/PP (NeMo's script needs TP=1,
PP=1 first); the output is TP=1, PP=1 in the checkpoint's precision. Training and serving here read
the legacy file directly too: the conversion is for tools that need megatron-core names.
``--input_name_or_path``/``--in-folder``/``--in-file`` and ``--output_path``/``--out-file`` (older NeMo
spellings) work; ``--cpu-only`` and ``--ignore-if-missing`` are accepted (the conversion runs on the
CPU; buffers NeMo's names hold, such as ``rotary_pos_emb.inv_freq``, are recomputed). An existing
output is kept unless ``--overwrite``.
"""

import argparse
import os

from nemo_aligner.utils.hydra_runner import run_cli


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--input-name-or-path", "--input_name_or_path", "--in-folder", "--in-file", dest="input",
                        required=True, help="a .nemo file or an extracted .nemo directory")
    parser.add_argument("--output-path", "--output_path", "--out-file", dest="output", required=True,
                        help="the megatron-core .nemo to write")
    parser.add_argument("--cpu-only", action="store_true", help="accepted: the conversion runs on the CPU")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing output file")
    parser.add_argument("--ignore-if-missing", default="rotary_pos_emb.inv_freq", help="accepted (see above)")
    args = parser.parse_args(argv)
    if os.path.exists(args.output) and not args.overwrite:
        print(f"{args.output} already exists; kept (--overwrite replaces it)", flush=True)
        return
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")  # NeMo's --cpu-only; a 70B model fits no GPU at TP=1
    from nemo_aligner.models.nlp.gpt.hf_interop import resave_as_mcore

    print(f"megatron-core .nemo written to {resave_as_mcore(args.input, args.output)}", flush=True)


if __name__ == "__main__":
    run_cli(main)
