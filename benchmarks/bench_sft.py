"""SFT training throughput: tokens/s and model FLOPs utilisation of our training step vs a plain
Hugging Face training loop (forward with labels, backward, fused AdamW) on the same model, data
and batch, alternating in one process. MFU is against this machine's measured matmul peak in the
same precision. On a GPU both run there in bf16 (ours: bf16 weights, float32 master weights in the
optimizer; HF: float32 weights under bf16 autocast, as HF's Trainer with ``bf16=True``).

    python benchmarks/bench_sft.py [--shapes tiny small] [--batch 8] [--seq 256] [--rounds 3] [--precision 32|bf16]
"""

from __future__ import annotations

import argparse
import time

import torch

from common import (bench_device, build_pair, default_precision, device_description, init_single_process, machine,
                    matmul_peak_gflops, race, synchronize, write_json)


def model_flops_per_token(cfg: dict, seq: int, params: int) -> float:
    """Training FLOPs per token: 6 x parameters plus causal attention (6 L S h: QK^T and AV, x3 for backward)."""
    return 6.0 * params + 6.0 * cfg["num_layers"] * seq * cfg["hidden_size"]


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["tiny", "small"])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps per timed run")
    parser.add_argument("--precision", choices=["32", "bf16"], default=default_precision(),
                        help="bf16 on a GPU, 32 on the CPU by default")
    args = parser.parse_args(argv)

    from omegaconf import OmegaConf

    init_single_process()
    bf16 = args.precision == "bf16"
    device = bench_device()
    peak = matmul_peak_gflops(dtype=torch.bfloat16 if bf16 else torch.float32)
    rows = []
    for shape in args.shapes:
        ours, hf = build_pair(shape, args.seq, trainable=True, precision=args.precision,
                              micro_batch=args.batch)  # one micro-batch per step, as HF's
        ours.setup_optimization(max_steps=1000, clip_grad=1.0)
        hf.train()
        hf_opt = torch.optim.AdamW(hf.parameters(), lr=1e-4, weight_decay=0.0, fused=True)
        g = torch.Generator().manual_seed(0)
        tokens = torch.randint(3, ours.tokenizer.vocab_size, (args.batch, args.seq + 1), generator=g)
        hf_inputs = tokens[:, :-1].to(device)
        batch = {"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(),
                 "loss_mask": torch.ones(args.batch, args.seq),
                 "position_ids": torch.arange(args.seq).unsqueeze(0).expand(args.batch, -1).contiguous()}

        def run_ours():
            start = time.perf_counter()
            for _ in range(args.steps):
                ours.prepare_for_training_step()
                ours.get_loss_and_metrics(batch, forward_only=False)
                ours.optimizer.step()
            synchronize()
            return time.perf_counter() - start

        def run_hf():
            start = time.perf_counter()
            for _ in range(args.steps):
                hf_opt.zero_grad(set_to_none=True)
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                    loss = hf(input_ids=hf_inputs, labels=hf_inputs).loss  # HF shifts labels itself
                loss.backward()
                torch.nn.utils.clip_grad_norm_(hf.parameters(), 1.0)
                hf_opt.step()
            synchronize()
            return time.perf_counter() - start

        cfg = OmegaConf.to_container(ours.cfg, resolve=True)
        params = sum(p.numel() for p in hf.parameters())
        flops = model_flops_per_token(cfg, args.seq, params)
        row = dict(shape=shape, params_M=params / 1e6,
                   **race(run_ours, run_hf, args.rounds, args.batch * args.seq * args.steps))
        row["hf_mfu"] = row["hf_tok_s"] * flops / 1e9 / peak
        row["ours_mfu"] = row["ours_tok_s"] * flops / 1e9 / peak
        rows.append(row)
        del ours, hf
    print(f"\nSFT step, batch {args.batch} x {args.seq} tokens, {'bf16' if bf16 else 'fp32'}, {device_description()}, "
          f"matmul peak {peak:.0f} GFLOP/s; median of {args.rounds} runs of {args.steps} steps")
    print(f"{'shape':<8} {'params':>8} {'HF tok/s':>9} {'ours tok/s':>11} {'ratio':>6} {'HF MFU':>7} {'ours MFU':>9}")
    for r in rows:
        print(f"{r['shape']:<8} {r['params_M']:>7.1f}M {r['hf_tok_s']:>9.0f} {r['ours_tok_s']:>11.0f} {r['ratio']:>6.2f} "
              f"{r['hf_mfu']:>7.1%} {r['ours_mfu']:>9.1%}")
    payload = {"benchmark": "sft", "machine": machine(), "peak_gflops": peak, "args": vars(args), "rows": rows}
    print("written", write_json("sft" + ("_bf16" if bf16 else ""), payload))
    return payload


if __name__ == "__main__":
    main()
