"""Convert an adapters-only LoRA .nemo to canonical adapters, or to a Hugging Face PEFT adapter directory.

NeMo's ``convert_nemo_to_canonical.py`` arguments:

    python examples/nlp/gpt/convert_nemo_to_canonical.py --nemo_lora_path lora.nemo --output_path canonical.nemo
    python examples/nlp/gpt/convert_nemo_to_canonical.py --nemo_lora_path lora.nemo --output_path hf_lora \\
        --hf_format [--hf_config adapter_config.json]

With ``--hf_format`` the directory holds ``adapter_config.json`` and ``adapter_model.safetensors`` for
``peft.PeftModel.from_pretrained`` on the base model's Hugging Face export (``convert_nemo_to_hf.py``).
"""

import argparse

from nemo_aligner.utils.hydra_runner import run_cli


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nemo_lora_path", required=True,
                        help="an adapters-only .nemo (NeMo's PEFT layout, any TP/PP)")
    parser.add_argument("--output_path", required=True, help="the canonical .nemo, or with --hf_format a directory")
    parser.add_argument("--hf_format", action="store_true", help="write a Hugging Face PEFT adapter directory")
    parser.add_argument("--hf_config", default=None,
                        help="an adapter_config.json whose other keys (base_model_name_or_path, ...) are kept")
    parser.add_argument("--precision", default=None, help="32, bf16 or 16; default: the dtype the adapters have")
    args = parser.parse_args(argv)
    from nemo_aligner.models.nlp.gpt import peft_interop

    if args.hf_format:
        out = peft_interop.nemo_to_hf_peft(args.nemo_lora_path, args.output_path, args.hf_config, args.precision)
        print(f"Hugging Face PEFT adapters written to {out}", flush=True)
    else:
        if args.hf_config:
            parser.error("--hf_config is read with --hf_format only")
        out = peft_interop.nemo_to_canonical(args.nemo_lora_path, args.output_path, args.precision)
        print(f"canonical adapters written to {out}", flush=True)


if __name__ == "__main__":
    run_cli(main)
