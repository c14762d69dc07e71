"""Convert a Hugging Face PEFT LoRA adapter directory to an adapters-only .nemo.

NeMo's ``convert_hf_to_canonical.py`` arguments:

    python examples/nlp/gpt/convert_hf_to_canonical.py --hf_lora_path hf_lora \\
        --output_path lora.nemo --nemo_config base.nemo

``--nemo_config``: the base model's ``model_config.yaml``, or the base ``.nemo`` itself (then the
adapters' config names it as their base). Llama-shaped models get canonical adapters
(``variant: canonical``), GPT-2-shaped ones NeMo's fused adapters. Use the result as
``model.peft.restore_from_path`` (with its ``peft.lora_tuning`` keys), with ``merge_lora_weights.py``,
or in ``generate_gpt.py``.
"""

import argparse

from nemo_aligner.utils.hydra_runner import run_cli


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hf_lora_path", required=True, help="a directory with adapter_config.json and "
                        "adapter_model.safetensors (or adapter_model.bin)")
    parser.add_argument("--output_path", required=True, help="the adapters-only .nemo to write")
    parser.add_argument("--nemo_config", required=True, help="the base model's model_config.yaml or .nemo")
    parser.add_argument("--precision", default=None, help="32, bf16 or 16; default: the dtype the adapters have")
    args = parser.parse_args(argv)
    from nemo_aligner.models.nlp.gpt import peft_interop

    out = peft_interop.hf_peft_to_nemo(args.hf_lora_path, args.output_path, args.nemo_config, args.precision)
    print(f"adapters written to {out}", flush=True)


if __name__ == "__main__":
    run_cli(main)
