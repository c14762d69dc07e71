"""Convert a local Hugging Face Llama / Qwen2 / GPT-2 directory to a .nemo (same logits).

    python examples/nlp/gpt/convert_hf_to_nemo.py --input-dir path/to/hf_model --output-file model.nemo
"""

import argparse

from nemo_aligner.utils.hydra_runner import run_cli


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--input-dir", required=True, help="config.json + *.safetensors (+ tokenizer files)")
    parser.add_argument("--output-file", required=True)
    args = parser.parse_args(argv)
    from nemo_aligner.models.nlp.gpt.hf_interop import import_hf_model

    print(f".nemo written to {import_hf_model(args.input_dir, args.output_file)}", flush=True)


if __name__ == "__main__":
    run_cli(main)
