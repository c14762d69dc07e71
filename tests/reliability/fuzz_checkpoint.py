"""Checkpoint fuzzing: run the scripts that start from a .nemo (DPO, reward model, KTO, SPIN, SteerLM,
GRPO, REINFORCE, rejection sampling, generation, the Hugging Face export and the mcore re-save) on one damaged copy of the base SFT model's .nemo
(cut short, a member missing, emptied or replaced with other bytes, bytes flipped inside a member,
a model_config.yaml value set to a hostile one) and report every run that ended in a traceback or a
hang instead of a one-line refusal or a finished run.

    python tests/reliability/fuzz_checkpoint.py                 # 120 runs, seed 0
    python tests/reliability/fuzz_checkpoint.py --runs 30 --targets dpo generate
    python tests/reliability/fuzz_checkpoint.py --moe            # the base model: 4 routed experts per layer
    python tests/reliability/fuzz_checkpoint.py --lora           # damaged adapters-only .nemo files instead

With ``--lora`` the damaged file is an adapters-only LoRA .nemo (adapters on every target of the base
SFT model), given to the PEFT export (``convert_nemo_to_canonical.py --hf_format``), the canonical
conversion and ``merge_lora_weights.py``.

Outcomes, output and exit status as ``fuzz_config.py``; ``--json PATH`` also records each run's damage.
A run that finishes is not a failure by itself: bytes flipped inside the weights give other, finite
weights, which no .nemo records a checksum to detect.
"""

from __future__ import annotations

import argparse
import io
import os
import random
import sys
import tarfile

import yaml

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fuzz_config import (Targets, arguments, check_base, finished, hostile_values, outcome, prepared,  # noqa: E402
                         run, run_all)

GPT_SCRIPTS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                           "examples", "nlp", "gpt")
# The converters that read a .nemo: their command for a .nemo and a run directory.
CONVERTERS = {
    "to_hf": lambda nemo, out: [sys.executable, os.path.join(GPT_SCRIPTS, "convert_nemo_to_hf.py"), "--input-file", nemo,
                                "--output-dir", os.path.join(out, "hf")],
    "to_mcore": lambda nemo, out: [sys.executable, os.path.join(GPT_SCRIPTS, "convert_gpt_nemo_to_mcore.py"),
                                   "--input-name-or-path", nemo, "--output-path", os.path.join(out, "mcore.nemo")],
}
# The scripts that read an adapters-only .nemo (--lora): their command for it, a run directory and the base.
LORA_CONVERTERS = {
    "lora_to_peft": lambda nemo, out, base: [sys.executable, os.path.join(GPT_SCRIPTS, "convert_nemo_to_canonical.py"),
                                             "--nemo_lora_path", nemo, "--output_path", os.path.join(out, "hf"),
                                             "--hf_format"],
    "lora_canonical": lambda nemo, out, base: [sys.executable, os.path.join(GPT_SCRIPTS, "convert_nemo_to_canonical.py"),
                                               "--nemo_lora_path", nemo, "--output_path",
                                               os.path.join(out, "canonical.nemo")],
    "lora_merge": lambda nemo, out, base: [sys.executable, os.path.join(GPT_SCRIPTS, "merge_lora_weights.py"),
                                           f"gpt_model_file={base}", f"lora_model_path={nemo}",
                                           f"merged_model_path={os.path.join(out, 'merged.nemo')}",
                                           "trainer.precision=32"],
}
# Writes LoRA adapters (all targets, random B) for the .nemo argv[1] to the adapters-only .nemo argv[2].
MAKE_ADAPTERS = """
import sys
from omegaconf import OmegaConf
from nemo_aligner.utils import distributed as D
D.init_distributed()
D.initialize_model_parallel(1, 1)
from nemo_aligner.models.nlp.gpt.gpt_sft_model import GPTSFTModel
from nemo_aligner.models.nlp.gpt.loading import load_model
from nemo_aligner.utils.nemo_file import save_nemo
cfg = OmegaConf.create({"micro_batch_size": 1, "peft": {"peft_scheme": "lora", "lora_tuning": {
    "target_modules": ["all"], "adapter_dim": 4, "row_init_method": "normal"}}})
save_nemo(load_model(GPTSFTModel, cfg, "32", sys.argv[1]), sys.argv[2])
"""
TARGETS = ([t for t in Targets.CONFIGS if t != "sft"] + list(CONVERTERS)  # SFT here starts from random weights
           + list(LORA_CONVERTERS))
DAMAGE = ["cut", "drop", "empty", "garbage", "flip", "config"]


def config_leaves(node, prefix=()) -> list:
    if isinstance(node, dict):
        return [leaf for key, value in node.items() for leaf in config_leaves(value, prefix + (key,))]
    return [(prefix, node)]


def damage(src: str, dst: str, rng: random.Random) -> str:
    """Write a damaged copy of the .nemo ``src`` to ``dst``; returns what was done."""
    kind = rng.choice(DAMAGE)
    if kind == "cut":
        data = open(src, "rb").read()
        at = rng.randrange(1, len(data))
        open(dst, "wb").write(data[:at])
        return f"cut at byte {at} of {len(data)}"
    with tarfile.open(src) as tin:
        members = [m for m in tin.getmembers() if m.isfile()]
        target = rng.choice([m for m in members if m.name.endswith("model_config.yaml")] if kind == "config" else members)
        what = f"{kind} {target.name}"
        with tarfile.open(dst, "w") as tout:
            for member in tin.getmembers():
                if not member.isfile() or member.name != target.name:
                    tout.addfile(member, tin.extractfile(member) if member.isfile() else None)
                    continue
                data = tin.extractfile(member).read()
                if kind == "drop":
                    continue
                if kind == "empty":
                    data = b""
                elif kind == "garbage":
                    data = rng.randbytes(len(data))
                elif kind == "flip":
                    start = rng.randrange(len(data))
                    span = rng.choice([1, 8, 256])
                    data = bytearray(data)
                    for i in range(start, min(start + span, len(data))):
                        data[i] ^= rng.randrange(1, 256)
                    data = bytes(data)
                    what += f" bytes {start}..{start + span}"
                elif kind == "config":
                    cfg = yaml.safe_load(data)
                    path, default = rng.choice(config_leaves(cfg))
                    value = yaml.safe_load(rng.choice(hostile_values(default)))
                    node = cfg
                    for key in path[:-1]:
                        node = node[key]
                    node[path[-1]] = value
                    data = yaml.safe_dump(cfg).encode()
                    what = f"model_config.yaml {'.'.join(map(str, path))}={value!r}"
                info = tarfile.TarInfo(member.name)
                info.size, info.mode, info.mtime = len(data), member.mode, member.mtime
                tout.addfile(info, io.BytesIO(data))
    return what


def main(argv=None) -> int:
    parser = arguments(__doc__, 120, TARGETS)
    parser.add_argument("--moe", action="store_true", help="fuzz a mixture-of-experts base model (Mixtral-shaped)")
    parser.add_argument("--lora", action="store_true", help="fuzz an adapters-only LoRA .nemo (the lora_* targets)")
    args = parser.parse_args(argv)
    if args.moe:
        Targets.SFT_EXTRA = ["++model.num_moe_experts=4", "++model.moe_router_topk=2", "++model.moe_aux_loss_coeff=0.01"]
    chosen = [t for t in args.targets if (t in LORA_CONVERTERS) == args.lora]
    args.targets = chosen or (list(LORA_CONVERTERS) if args.lora else chosen)
    if not args.targets:
        raise SystemExit("--targets: none of them fits (the lora_* targets go with --lora, the others without)")
    scripts = argparse.Namespace(**dict(vars(args), targets=[t for t in args.targets
                                                             if t not in CONVERTERS and t not in LORA_CONVERTERS]))
    work, targets = prepared(scripts, "fuzz_checkpoint_")
    source = targets.sft_nemo
    if args.lora:  # the file to damage: adapters for the base SFT model
        source = os.path.join(work, "base", "adapters.nemo")
        check_base("adapters", [sys.executable, "-c", MAKE_ADAPTERS, targets.sft_nemo, source], work, args.timeout_s)

    def command(target: str, nemo: str, out: str) -> list:
        if target in CONVERTERS or target in LORA_CONVERTERS:
            os.makedirs(out, exist_ok=True)
            if target in LORA_CONVERTERS:
                return LORA_CONVERTERS[target](nemo, out, targets.sft_nemo)
            return CONVERTERS[target](nemo, out)
        return [a.replace(targets.sft_nemo, nemo) for a in targets.command(target, out)]

    for target in (CONVERTERS.keys() | LORA_CONVERTERS.keys()) & set(args.targets):  # each base run must pass
        check_base(target, command(target, source, os.path.join(work, "base", target)), work, args.timeout_s)
    rng = random.Random(args.seed)
    cases = []
    for i in range(args.runs):
        path = os.path.join(work, "damaged", str(i), "model.nemo")
        os.makedirs(os.path.dirname(path))
        cases.append((i, rng.choice(args.targets), damage(source, path, rng), path))

    def one(case):
        i, target, what, path = case
        rc, out = run(command(target, path, os.path.join(work, "runs", str(i))), work, args.timeout_s)
        return {"target": target, "damage": what, **outcome(rc, out)}

    return finished(work, run_all(cases, one, args.workers, args.json, lambda r: f"{r['target']} {r['damage']}"),
                    args.keep)


if __name__ == "__main__":
    sys.exit(main())
