"""Convert a .nemo to a Hugging Face directory that transformers loads (Llama, Qwen2 or GPT-2 layout).

    python examples/nlp/gpt/convert_nemo_to_hf.py --input-file model.nemo --output-dir hf_model
"""

import argparse

from nemo_aligner.utils.hydra_runner import run_cli


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--input-file", required=True, help="a .nemo (any TP/PP it was saved at)")
    parser.add_argument("--output-dir", required=True)
    args = parser.parse_args(argv)
    from nemo_aligner.models.nlp.gpt.hf_interop import export_to_hf

    print(f"Hugging Face model written to {export_to_hf(args.input_file, args.output_dir)}", flush=True)


if __name__ == "__main__":
    run_cli(main)
