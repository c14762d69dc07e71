"""Hugging Face directory fuzzing: run ``convert_hf_to_nemo.py`` on a tiny Llama, Mistral, Mixtral, Gemma,
Qwen2 or GPT-2 directory (made here, random weights) with one hostile change: a ``config.json`` value set to
text, null, a list, a dict, -1, 0, 1.5, 1e18, NaN, a string for a flag, or removed; a tensor of the
weights cut to another shape or removed; a tokenizer file emptied or overwritten. Report every run that
ended in a traceback or a hang instead of a one-line refusal or a finished conversion.

    python tests/reliability/fuzz_hf.py                         # 100 runs, seed 0
    python tests/reliability/fuzz_hf.py --runs 40 --seed 3 --targets llama gpt2

With ``--peft`` the directory is a PEFT LoRA adapter directory (made with ``peft`` on the tiny model)
and the command ``convert_hf_to_canonical.py --nemo_config <the model's .nemo>``; the changes: an
``adapter_config.json`` value, a LoRA matrix cut or removed, the weights file overwritten.

Outcomes, output and exit status as ``fuzz_config.py``; ``--json PATH`` also records each run's change.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fuzz_config import arguments, check_base, finished, outcome, run, run_all, tokenizer_directory  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONVERT = os.path.join(REPO, "examples", "nlp", "gpt", "convert_hf_to_nemo.py")
CONVERT_PEFT = os.path.join(REPO, "examples", "nlp", "gpt", "convert_hf_to_canonical.py")
PEFT_TARGETS = {"gpt2": ["c_attn", "c_proj", "c_fc"], "mixtral": ["q_proj", "v_proj", "o_proj"]}
ARCHS = ["llama", "mistral", "mixtral", "gemma", "qwen2", "gpt2"]
MISSING = object()
HOSTILE = [MISSING, None, "abc", "", "false", -1, 0, 1.5, 1e18, float("nan"), True, [1, 2], {"a": 1}]


def tiny_directory(arch: str, path: str) -> None:
    """A tiny random ``arch`` model with a word-level tokenizer, saved as Hugging Face saves it."""
    import torch
    import transformers as tf

    tf.utils.logging.set_verbosity_error()
    tf.utils.logging.disable_progress_bar()
    torch.manual_seed(0)
    common = dict(vocab_size=300, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64)
    if arch == "gpt2":
        model = tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=300, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                                                    bos_token_id=1, eos_token_id=2))
    else:
        config = {"llama": tf.LlamaConfig, "mistral": tf.MistralConfig, "gemma": tf.GemmaConfig,
                  "qwen2": tf.Qwen2Config, "mixtral": tf.MixtralConfig}[arch]
        if arch == "mixtral":
            common = dict(common, num_local_experts=4, num_experts_per_tok=2)
        model = tf.AutoModelForCausalLM.from_config(config(hidden_size=64, intermediate_size=96, num_key_value_heads=2,
                                                           **common))
    model.save_pretrained(path)
    tokenizer_directory(path)


def peft_directory(arch: str, model_dir: str, path: str) -> None:
    """LoRA adapters (random A and B) made with ``peft`` on the model in ``model_dir``."""
    import peft
    import torch
    import transformers as tf

    torch.manual_seed(1)
    targets = PEFT_TARGETS.get(arch, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False,
                             fan_in_fan_out=arch == "gpt2")
    peft.get_peft_model(tf.AutoModelForCausalLM.from_pretrained(model_dir), config).save_pretrained(path)


def _change_json(directory: str, name: str, rng: random.Random) -> str:
    """One key of the JSON object ``name`` set to a hostile value or removed."""
    path = os.path.join(directory, name)
    config = json.load(open(path, encoding="utf-8"))
    key, value = rng.choice(sorted(config)), rng.choice(HOSTILE)
    if value is MISSING:
        del config[key]
    else:
        config[key] = value
    with open(path, "w", encoding="utf-8") as f:
        json.dump(config, f)  # NaN as JSON's NaN, which json.load reads back
    return f"{name} {key}={'<removed>' if value is MISSING else repr(value)}"


def _change_tensor(directory: str, name: str, rng: random.Random) -> str:
    """One tensor of the safetensors file ``name`` removed or cut to another shape."""
    from safetensors.torch import load_file, save_file

    path = os.path.join(directory, name)
    state = load_file(path)
    key = rng.choice(sorted(state))
    if rng.random() < 0.3:
        del state[key]
        what = f"tensor {key} removed"
    else:
        state[key] = state[key].flatten()[: max(1, state[key].numel() // 2)].clone()
        what = f"tensor {key} cut to {list(state[key].shape)}"
    save_file(state, path, metadata={"format": "pt"})
    return what


def _overwrite(directory: str, names: list, rng: random.Random) -> str:
    name = rng.choice(names)
    data = rng.choice([b"", b"[1, 2]", b"{\"a\": 1}", b"\xff\xfe not text"])
    with open(os.path.join(directory, name), "wb") as f:
        f.write(data)
    return f"{name} = {data!r}"


# What a change touches in each kind of directory: (JSON config, safetensors weights, files to
# overwrite, weights of the config/tensor/file kinds of change).
LAYOUTS = {"model": ("config.json", "model.safetensors",
                     ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"], [6, 2, 1]),
           "peft": ("adapter_config.json", "adapter_model.safetensors",
                    ["adapter_model.safetensors", "adapter_config.json"], [6, 3, 1])}


def change(directory: str, rng: random.Random, layout: str = "model") -> str:
    """Apply one hostile change to the model (or PEFT adapter) directory; returns what was done."""
    config, weights, files, odds = LAYOUTS[layout]
    kind = rng.choices(["config", "tensor", "file"], weights=odds)[0]
    if kind == "config":
        return _change_json(directory, config, rng)
    if kind == "tensor":
        return _change_tensor(directory, weights, rng)
    return _overwrite(directory, files, rng)


def main(argv=None) -> int:
    import tempfile

    parser = arguments(__doc__, 100, ARCHS)
    parser.add_argument("--peft", action="store_true", help="fuzz PEFT adapter directories instead")
    args = parser.parse_args(argv)
    work = tempfile.mkdtemp(prefix="fuzz_hf_")

    def command(arch, directory, out):
        if args.peft:
            return [sys.executable, CONVERT_PEFT, "--hf_lora_path", directory, "--output_path", out,
                    "--nemo_config", os.path.join(work, "base", f"{arch}.nemo")]
        return [sys.executable, CONVERT, "--input-dir", directory, "--output-file", out]

    for arch in args.targets:  # each base directory (and with --peft its adapters) must convert
        tiny_directory(arch, os.path.join(work, "base", arch))
        check_base(arch, [sys.executable, CONVERT, "--input-dir", os.path.join(work, "base", arch), "--output-file",
                          os.path.join(work, "base", f"{arch}.nemo")], work, args.timeout_s)
        if args.peft:
            peft_directory(arch, os.path.join(work, "base", arch), os.path.join(work, "base", f"{arch}_lora"))
            check_base(arch, command(arch, os.path.join(work, "base", f"{arch}_lora"),
                                     os.path.join(work, "base", f"{arch}_lora.nemo")), work, args.timeout_s)
    rng = random.Random(args.seed)
    cases = []
    for i in range(args.runs):
        arch = rng.choice(args.targets)
        directory = os.path.join(work, "changed", str(i))
        shutil.copytree(os.path.join(work, "base", f"{arch}_lora" if args.peft else arch), directory)
        cases.append((i, arch, change(directory, rng, "peft" if args.peft else "model"), directory))

    def one(case):
        i, arch, what, directory = case
        rc, out = run(command(arch, directory, os.path.join(directory, "out.nemo")), work, args.timeout_s)
        return {"target": arch, "change": what, **outcome(rc, out)}

    return finished(work, run_all(cases, one, args.workers, args.json, lambda r: f"{r['target']} {r['change']}"),
                    args.keep)


if __name__ == "__main__":
    sys.exit(main())
