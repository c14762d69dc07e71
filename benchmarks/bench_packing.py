"""Packed against padded SFT on a length-skewed dataset: trained tokens per second over one pass.

    python benchmarks/bench_packing.py [--shape tiny] [--samples 256] [--max-len 512] [--batch 8] [--rounds 3]

Sample lengths are drawn from a log-normal distribution (median ~60 tokens, a tail to ``--max-len``),
as instruction data is. Padded: batches of ``--batch`` samples, each padded to its longest sample
(rounded up to 8, as ``collate_sft`` does). Packed: the same samples packed (first fit, shuffled) into
rows of ``--max-len`` tokens, batches of packs holding about as many tokens as a padded batch's
``--max-len`` rows would. Both run forward, backward and an optimizer step per batch on the same model
and count only real (non-padding) tokens. The two sides alternate, reversing which goes first every
other round; medians are reported. Results: ``benchmarks/results/<device>/packing[_bf16].json``.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import alternate, default_precision, init_single_process, machine, median, model_cfg, synchronize, write_json  # noqa: E402


def skewed_lengths(n: int, max_len: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.exp(torch.randn(n, generator=g) * 0.9 + math.log(60)).round().clamp(8, max_len)
    return [int(x) for x in lengths]


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="tiny")
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--max-len", type=int, default=512)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--precision", default=default_precision(), choices=["32", "bf16"])
    args = parser.parse_args(argv)

    from omegaconf import OmegaConf

    from nemo_aligner.data.nlp.packing import collate_packs, pack_sft_samples
    from nemo_aligner.data.nlp.sft_dataset import collate_sft
    from nemo_aligner.models.nlp.gpt.gpt_sft_model import GPTSFTModel
    from nemo_aligner.utils.tokenizers import ByteTokenizer

    init_single_process()
    torch.manual_seed(0)
    model = GPTSFTModel(OmegaConf.create(model_cfg(args.shape, args.max_len, 1)), ByteTokenizer(), args.precision)
    model.setup_optimization(max_steps=10 ** 6, clip_grad=1.0)
    g = torch.Generator().manual_seed(1)
    lengths = skewed_lengths(args.samples, args.max_len)
    samples = [{"input_ids": torch.randint(3, 250, (n,), generator=g).tolist(), "answer_start": 1} for n in lengths]
    real = sum(n - 1 for n in lengths)  # trained positions (each sample predicts all but its first token)

    padded = [collate_sft(samples[i : i + args.batch], 0, args.max_len)
              for i in range(0, len(samples), args.batch)]
    packs = pack_sft_samples([{"input_ids": s["input_ids"], "loss_mask": [True] * len(s["input_ids"])}
                              for s in samples], args.max_len, "first_fit_shuffle", 0)
    packs = [{"input_ids": p["input_ids"], "loss_mask": p["loss_mask"], "boundaries": p["seq_start_id"] +
              [len(p["input_ids"])]} for p in packs]
    per_batch = max(1, round(args.batch * sum(lengths) / len(samples) / args.max_len * 1.0))
    packed = [collate_packs(packs[i : i + per_batch], 0, args.max_len) for i in range(0, len(packs), per_batch)]
    padded_positions = sum(b["tokens"].numel() for b in padded)
    packed_positions = sum(b["tokens"].numel() for b in packed)

    def run(batches):
        def timed():
            start = time.perf_counter()
            for batch in batches:
                model.micro_batch_size = batch["tokens"].shape[0]
                model.prepare_for_training_step()
                model.get_loss_and_metrics(batch, forward_only=False)
                model.optimizer.step()
            synchronize()
            return time.perf_counter() - start
        return timed

    run(padded[:1])()
    run(packed[:1])()  # warm-up
    times = alternate({"padded": run(padded), "packed": run(packed)}, args.rounds)
    result = {
        "shape": args.shape, "samples": args.samples, "max_len": args.max_len, "precision": args.precision,
        "median_length": sorted(lengths)[len(lengths) // 2], "mean_length": sum(lengths) / len(lengths),
        "trained_tokens": real,
        "padded": {"batches": len(padded), "positions": padded_positions, "seconds": median(times["padded"]),
                   "tokens_per_s": real / median(times["padded"])},
        "packed": {"batches": len(packed), "packs": len(packs), "positions": packed_positions,
                   "seconds": median(times["packed"]), "tokens_per_s": real / median(times["packed"])},
        "times": times, "machine": machine(),
    }
    result["speedup"] = result["packed"]["tokens_per_s"] / result["padded"]["tokens_per_s"]
    print(f"{args.samples} samples (median {result['median_length']} tokens, longest {max(lengths)}), "
          f"{real} trained tokens")
    for side in ("padded", "packed"):
        r = result[side]
        print(f"{side:7} {r['batches']:4} batches {r['positions']:8} positions {r['seconds']:7.2f} s "
              f"{r['tokens_per_s']:9.0f} trained tokens/s")
    print(f"packed / padded: {result['speedup']:.2f}x")
    name = "packing" + ("_bf16" if args.precision == "bf16" else "")
    print("wrote", write_json(name, result))
    return result


if __name__ == "__main__":
    main()
