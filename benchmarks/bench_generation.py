"""Rollout generation: new tokens/s of our KV-cache decode loop vs Hugging Face ``generate`` on a
model with identical weights, same prompts and sampling, alternating runs in one process.

    python benchmarks/bench_generation.py [--shapes tiny small] [--rounds 3] [--sample]
"""

from __future__ import annotations

import argparse
import time

import torch

from common import build_pair, init_single_process, machine, race, write_json


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["tiny", "small"])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--sample", action="store_true", help="temperature 1.0 sampling instead of greedy")
    args = parser.parse_args(argv)

    from nemo_aligner.utils.generation import LengthParams, SamplingParams, generate

    init_single_process()
    rows = []
    for shape in args.shapes:
        ours, hf = build_pair(shape, args.prompt + args.new_tokens)
        ours.eval()
        tok = ours.tokenizer
        g = torch.Generator().manual_seed(1)
        prompts = torch.randint(3, tok.vocab_size, (args.batch, args.prompt), generator=g)
        sampling = SamplingParams(use_greedy=not args.sample, temperature=1.0)
        length = LengthParams(max_length=args.new_tokens, min_length=args.new_tokens)
        outputs = {}

        def run_ours():
            start = time.perf_counter()
            out = generate(ours.module, tok, prompts.tolist(), sampling, length, seed=0)
            elapsed = time.perf_counter() - start
            outputs["ours"] = out.tokens[:, args.prompt : args.prompt + args.new_tokens]
            return elapsed

        def run_hf():
            start = time.perf_counter()
            with torch.no_grad():
                out = hf.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=args.new_tokens,
                                  min_new_tokens=args.new_tokens, do_sample=args.sample, temperature=1.0, top_k=0,
                                  top_p=1.0, eos_token_id=tok.eos_id, pad_token_id=tok.eos_id)
            elapsed = time.perf_counter() - start
            outputs["hf"] = out[:, args.prompt :]
            return elapsed

        row = dict(shape=shape, **race(run_ours, run_hf, args.rounds, args.batch * args.new_tokens))
        row["identical_greedy_tokens"] = bool(torch.equal(outputs["ours"], outputs["hf"])) if not args.sample else None
        rows.append(row)
        del ours, hf
    print(f"\nGeneration, batch {args.batch}, prompt {args.prompt}, {args.new_tokens} new tokens, "
          f"{'sampling' if args.sample else 'greedy'}, fp32, {torch.get_num_threads()} threads; median of {args.rounds}")
    print(f"{'shape':<8} {'HF tok/s':>10} {'ours tok/s':>11} {'ratio':>7} {'same tokens':>12}")
    for r in rows:
        print(f"{r['shape']:<8} {r['hf_tok_s']:>10.0f} {r['ours_tok_s']:>11.0f} {r['ratio']:>7.2f} "
              f"{str(r['identical_greedy_tokens']):>12}")
    payload = {"benchmark": "generation", "machine": machine(), "args": vars(args), "rows": rows}
    print("written", write_json("generation" + ("_sample" if args.sample else ""), payload))
    return payload


if __name__ == "__main__":
    main()
