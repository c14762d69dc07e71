"""SFT training throughput: tokens/s and model FLOPs utilisation of our training step vs a plain
Hugging Face training loop (forward with labels, backward, fused AdamW) on the same model, data
and batch, alternating in one process. MFU is against this machine's measured matmul peak in the
same precision. On a GPU both run there in bf16 (ours: bf16 weights, float32 master weights in the
optimizer; HF: float32 weights under bf16 autocast, as HF's Trainer with ``bf16=True``).

    python benchmarks/bench_sft.py [--shapes tiny small] [--batch 8] [--seq 256] [--rounds 3] [--precision 32|bf16]

``--trl`` adds TRL's ``SFTTrainer`` as a third side (the same HF model, batch, optimizer, clipping
and precision; pre-tokenized rows, no packing or padding, no activation checkpointing); TRL lives in
the benchmark venv: ``make bench-venv && (cd benchmarks && ../.venv-bench/bin/python bench_sft.py --trl)``.
Each TRL run is one ``train()`` of ``--steps`` + 1 steps whose first step (optimizer state, start-up)
is not timed.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from common import (alternate, bench_device, build_pair, byte_tokenizer_dir, default_precision, device_description,
                    init_single_process, machine, matmul_peak_gflops, median, scratch_dir, synchronize,
                    trainer_step_timer, write_json)


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
    parser.add_argument("--trl", action="store_true", help="also time TRL's SFTTrainer (needs the benchmark venv)")
    args = parser.parse_args(argv)
    if args.trl:
        try:
            import trl  # noqa: F401
            from datasets import Dataset  # noqa: F401
        except ImportError:
            raise SystemExit("bench_sft.py --trl needs TRL and datasets: make bench-venv, then run it with "
                             ".venv-bench/bin/python")

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

        contenders = {"ours": run_ours, "hf": run_hf}
        if args.trl:
            contenders["trl"] = trl_runner(hf, tokens[:, :-1], args, bf16)
        cfg = OmegaConf.to_container(ours.cfg, resolve=True)
        params = sum(p.numel() for p in hf.parameters())
        flops = model_flops_per_token(cfg, args.seq, params)
        for run in contenders.values():  # warm-up
            run()
        times = alternate(contenders, args.rounds)
        units = args.batch * args.seq * args.steps
        row = dict(shape=shape, params_M=params / 1e6)
        for side, seconds in times.items():
            row[f"{side}_tok_s"] = units / median(seconds)
            row[f"{side}_s"] = seconds
            row[f"{side}_mfu"] = row[f"{side}_tok_s"] * flops / 1e9 / peak
        row["ratio"] = row["ours_tok_s"] / row["hf_tok_s"]
        if args.trl:
            row["ratio_trl"] = row["ours_tok_s"] / row["trl_tok_s"]
        rows.append(row)
        del ours, hf
    print(f"\nSFT step, batch {args.batch} x {args.seq} tokens, {'bf16' if bf16 else 'fp32'}, {device_description()}, "
          f"matmul peak {peak:.0f} GFLOP/s; median of {args.rounds} runs of {args.steps} steps")
    trl_head = f" {'TRL tok/s':>10} {'vs TRL':>7} {'TRL MFU':>8}" if args.trl else ""
    print(f"{'shape':<8} {'params':>8} {'HF tok/s':>9} {'ours tok/s':>11} {'ratio':>6} {'HF MFU':>7} {'ours MFU':>9}"
          + trl_head)
    for r in rows:
        trl_cols = (f" {r['trl_tok_s']:>10.0f} {r['ratio_trl']:>7.2f} {r['trl_mfu']:>8.1%}" if args.trl else "")
        print(f"{r['shape']:<8} {r['params_M']:>7.1f}M {r['hf_tok_s']:>9.0f} {r['ours_tok_s']:>11.0f} {r['ratio']:>6.2f} "
              f"{r['hf_mfu']:>7.1%} {r['ours_mfu']:>9.1%}" + trl_cols)
    payload = {"benchmark": "sft", "machine": machine(), "peak_gflops": peak, "args": vars(args), "rows": rows}
    print("written", write_json("sft" + ("_bf16" if bf16 else ""), payload))
    return payload


def trl_runner(hf, inputs: torch.Tensor, args, bf16: bool):
    """A callable that trains ``hf`` for ``args.steps`` timed steps with TRL's ``SFTTrainer`` (after one
    untimed step) on ``inputs`` [batch, seq] repeated, and returns their seconds."""
    import trl
    from datasets import Dataset
    from transformers import AutoTokenizer

    work = scratch_dir("bench_sft_trl_")
    tokenizer = AutoTokenizer.from_pretrained(byte_tokenizer_dir(work))
    rows = inputs.cpu().tolist() * (args.steps + 1)  # one batch per step, the same rows as the others
    dataset = Dataset.from_dict({"input_ids": rows})

    def run_trl():
        timer = trainer_step_timer()
        config = trl.SFTConfig(output_dir=os.path.join(work, "out"), per_device_train_batch_size=args.batch,
                               gradient_accumulation_steps=1, max_steps=args.steps + 1, learning_rate=1e-4,
                               lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=1.0,
                               optim="adamw_torch_fused", bf16=bf16, fp16=False, use_cpu=not torch.cuda.is_available(),
                               max_length=args.seq, packing=False, gradient_checkpointing=False,
                               dataloader_num_workers=0, report_to="none", save_strategy="no", logging_steps=1000,
                               seed=0)
        trainer = trl.SFTTrainer(model=hf, args=config, train_dataset=dataset, processing_class=tokenizer,
                                 callbacks=[timer])
        trainer.train()
        hf.train()
        return sum(timer.seconds[1:])

    return run_trl


if __name__ == "__main__":
    main()
