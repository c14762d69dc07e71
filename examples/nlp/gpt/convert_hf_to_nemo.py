"""Convert a local Hugging Face Llama / Mistral / Qwen2 / GPT-2 directory to a .nemo (same logits).

    python examples/nlp/gpt/convert_hf_to_nemo.py --input-dir path/to/hf_model --output-file model.nemo

NeMo's converters' spellings work too, so their commands run with the script's path changed:
``--input_name_or_path``/``--in-file`` for ``--input-dir``, ``--output_path``/``--out-file`` for
``--output-file``, and ``--precision`` (32, bf16 or 16: the dtype the weights are stored in; default 32).
The input must be a local directory: nothing is downloaded.
"""

import argparse

from nemo_aligner.utils.hydra_runner import run_cli


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--input-dir", "--input_name_or_path", "--in-file", dest="input_dir", required=True,
                        help="config.json + *.safetensors (+ tokenizer files)")
    parser.add_argument("--output-file", "--output_path", "--out-file", dest="output_file", required=True)
    parser.add_argument("--precision", default="32", help="32, bf16 or 16 (NeMo's spellings too: bf16-mixed, ...)")
    args = parser.parse_args(argv)
    from nemo_aligner.models.nlp.gpt.hf_interop import import_hf_model

    print(f".nemo written to {import_hf_model(args.input_dir, args.output_file, args.precision)}", flush=True)


if __name__ == "__main__":
    run_cli(main)
