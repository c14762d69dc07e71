"""LoRA against full fine-tuning on the same model: the memory a run keeps beside the weights (the
reference policy's or reward model's second copy, gradients, optimizer state) and the training step.

    python benchmarks/bench_lora.py [--shapes small medium] [--batch 4] [--seq 256] [--steps 3] [--precision 32|bf16]

Memory is counted from the tensors each side really holds after its first optimizer step (this
rank): the copy ``cpu_weights_copy`` makes (what DPO's reference policy, PPO's initial policy and
the critic's co-located reward model keep), DDP's gradient buffers and the optimizer's state.
LoRA is NeMo-Aligner's default (``adapter_dim`` 32 on ``attention_qkv``) and the same on every
linear layer (``target_modules=[all]``). Step times are medians of ``--steps`` steps after one
warm-up step. Results go to ``benchmarks/results/<device>/lora[_bf16].json``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import default_precision, init_single_process, machine, model_cfg, synchronize, write_json  # noqa: E402

VARIANTS = {
    "full": None,
    "lora_qkv": {"target_modules": ["attention_qkv"], "adapter_dim": 32},
    "lora_all": {"target_modules": ["all"], "adapter_dim": 32},
}


def _bytes(tensors) -> int:
    return int(sum(t.numel() * t.element_size() for t in tensors if torch.is_tensor(t)))


def optimizer_state_bytes(optimizer) -> int:
    """Bytes of the state the optimizer keeps (Adam moments, fp32 master copies of low-precision weights)."""
    total = 0
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", opt)
        for state in inner.state.values():
            total += _bytes(state.values())
        for group in getattr(opt, "fp32_from_float16_groups", []) or []:
            total += _bytes(group)
    return total


def measure(shape: str, variant: str, args) -> dict:
    from omegaconf import OmegaConf

    from nemo_aligner.models.nlp.gpt.gpt_sft_model import GPTSFTModel
    from nemo_aligner.utils.tokenizers import ByteTokenizer

    cfg = model_cfg(shape, args.seq, args.batch)
    if VARIANTS[variant] is not None:
        cfg["peft"] = {"peft_scheme": "lora", "lora_tuning": VARIANTS[variant]}
    torch.manual_seed(0)
    model = GPTSFTModel(OmegaConf.create(cfg), ByteTokenizer(), args.precision, trainable=True)
    model.setup_optimization(max_steps=1000, clip_grad=1.0)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, model.tokenizer.vocab_size, (args.batch, args.seq + 1), generator=g)
    batch = {"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(),
             "loss_mask": torch.ones(args.batch, args.seq),
             "position_ids": torch.arange(args.seq).unsqueeze(0).expand(args.batch, -1).contiguous()}
    times = []
    for step in range(args.steps + 1):
        start = time.perf_counter()
        model.prepare_for_training_step()
        model.get_loss_and_metrics(batch, forward_only=False)
        model.optimizer.step()
        synchronize()
        if step:
            times.append(time.perf_counter() - start)
    params = list(model.module.parameters())
    trained = [p for p in params if p.requires_grad]
    row = {
        "shape": shape, "variant": variant, "parameters": sum(p.numel() for p in params),
        "trained_parameters": sum(p.numel() for p in trained),
        "weights_bytes": _bytes(params),
        "weight_copy_bytes": _bytes(model.cpu_weights_copy().values()),
        "gradient_bytes": _bytes(getattr(p, "main_grad", None) for p in trained),
        "optimizer_state_bytes": optimizer_state_bytes(model.optimizer),
        "step_s": statistics.median(times),
    }
    row["tokens_per_s"] = args.batch * args.seq / row["step_s"]
    return row


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["small", "medium"])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--precision", default=default_precision(), choices=["32", "bf16"])
    args = parser.parse_args(argv)
    init_single_process()
    rows = [measure(shape, variant, args) for shape in args.shapes for variant in VARIANTS]
    mb = 2 ** 20
    print(f"{'shape':8} {'variant':9} {'trained':>12} {'weight copy MB':>15} {'grads MB':>9} {'optimizer MB':>13} "
          f"{'step s':>7} {'tokens/s':>9}")
    for r in rows:
        print(f"{r['shape']:8} {r['variant']:9} {r['trained_parameters']:>12,} {r['weight_copy_bytes'] / mb:>15.1f} "
              f"{r['gradient_bytes'] / mb:>9.1f} {r['optimizer_state_bytes'] / mb:>13.1f} {r['step_s']:>7.3f} "
              f"{r['tokens_per_s']:>9.0f}")
    payload = {"machine": machine(), "precision": args.precision,
               "batch": args.batch, "seq": args.seq, "steps": args.steps, "results": rows}
    name = "lora" + ("_bf16" if args.precision == "bf16" else "")
    print("wrote", write_json(name, payload))
    return payload


if __name__ == "__main__":
    main()
