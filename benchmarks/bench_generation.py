"""Rollout generation: new tokens/s of our KV-cache decode loop vs Hugging Face ``generate`` on a
model with identical weights, same prompts and sampling, alternating runs in one process. On a GPU
both run there in bf16 (bf16 weights on both sides).

    python benchmarks/bench_generation.py [--shapes tiny small] [--rounds 3] [--sample] [--precision 32|bf16]
        [--hf-static-compile] [--cuda-graphs]

Each decode step is also reported against its memory floor: the bytes of weights and KV cache it
must read, over the bandwidth measured by a large copy.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.nn.functional as F

from common import (alternate, bench_device, build_pair, default_precision, device_description, init_single_process,
                    machine, median, memory_bandwidth_gbs, race, synchronize, write_json)


def kernel_floor(module, prompts: torch.Tensor, new_tokens: int, rounds: int = 3) -> dict:
    """A lower bound for our generation on this machine's kernels: ``prefill_s``, our prefill of
    ``prompts`` [B, P]; ``decode_step_s``, one decode step's unskippable work run back to back with
    nothing else (every layer's matmuls through the decode loop's own packed callables, one query
    per row attending over a per-layer cache at its mean length with the loop's own attention: the
    fused kernel where it runs, else SDPA; the output layer).
    Medians of ``rounds``."""
    from nemo_aligner.models.nlp.gpt.generation import KVCacheDecoder

    batch, prompt = prompts.shape
    decoder = KVCacheDecoder(module, batch, prompt + new_tokens // 2)
    positions = torch.arange(prompt).expand(batch, prompt)
    key_mask = torch.ones(batch, prompt + new_tokens // 2, dtype=torch.bool)
    like = dict(dtype=decoder.dtype, device=decoder.device)
    x = torch.randn(1, batch, module.config.hidden_size, **like)
    inner = torch.randn(1, batch, module.decoder.layers[0].mlp.linear_fc2.weight.shape[1], **like)
    q = torch.randn(batch, decoder.heads, 1, decoder.head_dim, **like)
    gqa = decoder.heads != decoder.groups
    per_group = decoder.heads // decoder.groups
    # the fused attention takes float32 query rows (a bf16 model's too)
    qkv = torch.randn(batch, decoder.groups * (per_group + 2) * decoder.head_dim, dtype=torch.float32)
    end = prompt + new_tokens // 2

    def attention(index, keys, values):
        if decoder.fused is not None:  # the loop's own attention kernel
            decoder.fused["ext"].decode_attention(qkv, decoder.layer_cache[index], end, None, decoder.scale,
                                                  decoder.groups, per_group)
        else:
            F.scaled_dot_product_attention(q, keys, values, scale=decoder.scale, enable_gqa=gqa)

    def decode_step():
        for index, (plan, keys, values) in enumerate(zip(decoder.layers, decoder.layer_keys, decoder.layer_values)):
            plan["qkv"](x), plan["proj"](x), plan["fc1"](x), plan["fc2"](inner)
            attention(index, keys, values)
        decoder.output(x)

    def timed(fn) -> float:
        fn()
        synchronize()
        times = []
        for _ in range(rounds):
            start = time.perf_counter()
            fn()
            synchronize()
            times.append(time.perf_counter() - start)
        return median(times)

    with torch.inference_mode():  # as the decode loop runs
        return {"prefill_s": timed(lambda: decoder.forward(prompts, positions, 0, key_mask, False)),
                "decode_step_s": timed(decode_step),
                "cache_bytes": decoder.cache.numel() * decoder.cache.element_size()}  # at the mean length


def weight_bytes_per_decode_step(module) -> int:
    """The weights one decode step must read from memory: every linear layer's (the output layer's included)."""
    weights = [module.output_layer.weight if module.output_layer.weight is not None
               else module.shared_embedding_or_output_weight()]
    for layer in module.decoder.layers:
        weights += [layer.self_attention.linear_qkv.weight, layer.self_attention.linear_proj.weight,
                    layer.mlp.linear_fc1.weight, layer.mlp.linear_fc2.weight]
    return sum(w.numel() * w.element_size() for w in weights)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["tiny", "small"])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--sample", action="store_true", help="temperature 1.0 sampling instead of greedy")
    parser.add_argument("--precision", choices=["32", "bf16"], default=default_precision(),
                        help="bf16 on a GPU, 32 on the CPU by default")
    parser.add_argument("--hf-static-compile", action="store_true",
                        help="also race HF generate with a static cache and a torch.compile'd forward (its fastest built-in path)")
    parser.add_argument("--cuda-graphs", action="store_true",
                        help="our decode steps replay a captured CUDA graph (NEMO_ALIGNER_CUDA_GRAPHS=1; a GPU only)")
    args = parser.parse_args(argv)
    os.environ["NEMO_ALIGNER_CUDA_GRAPHS"] = "1" if args.cuda_graphs else "0"

    from nemo_aligner.models.nlp.gpt.generation import LengthParams, SamplingParams, generate

    init_single_process()
    bandwidth = memory_bandwidth_gbs()
    rows = []
    for shape in args.shapes:
        ours, hf = build_pair(shape, args.prompt + args.new_tokens, precision=args.precision)
        if args.precision == "bf16":
            hf = hf.to(torch.bfloat16)
        ours.eval()
        tok = ours.tokenizer
        g = torch.Generator().manual_seed(1)
        prompts = torch.randint(3, tok.vocab_size, (args.batch, args.prompt), generator=g)
        hf_prompts = prompts.to(bench_device())
        sampling = SamplingParams(use_greedy=not args.sample, temperature=1.0)
        length = LengthParams(max_length=args.new_tokens, min_length=args.new_tokens)
        outputs = {}

        def run_ours():
            start = time.perf_counter()
            out = generate(ours.module, tok, prompts.tolist(), sampling, length, seed=0)
            synchronize()
            elapsed = time.perf_counter() - start
            outputs["ours"] = out.tokens[:, args.prompt : args.prompt + args.new_tokens]
            return elapsed

        padding_ids = list(range(tok.vocab_size, hf.config.vocab_size))

        def run_hf():
            start = time.perf_counter()
            # inference_mode, as ours (it saves autograd bookkeeping on either side); the padded
            # vocabulary rows are never sampled, as ours never samples them
            with torch.inference_mode():
                out = hf.generate(hf_prompts, attention_mask=torch.ones_like(hf_prompts), max_new_tokens=args.new_tokens,
                                  min_new_tokens=args.new_tokens, do_sample=args.sample, temperature=1.0, top_k=0,
                                  top_p=1.0, eos_token_id=tok.eos_id, pad_token_id=tok.eos_id,
                                  suppress_tokens=padding_ids)
            synchronize()
            elapsed = time.perf_counter() - start
            outputs["hf"] = out[:, args.prompt :].cpu()
            return elapsed

        row = dict(shape=shape, **race(run_ours, run_hf, args.rounds, args.batch * args.new_tokens))
        if args.hf_static_compile:
            import copy

            fast = copy.deepcopy(hf)
            # HF's fastest built-in decode: a static cache and a compiled forward (CUDA graphs on a GPU)
            fast.forward = torch.compile(fast.forward, mode="reduce-overhead" if torch.cuda.is_available() else None,
                                         fullgraph=True)

            def run_hf_fast():
                start = time.perf_counter()
                with torch.inference_mode():
                    out = fast.generate(hf_prompts, attention_mask=torch.ones_like(hf_prompts),
                                        max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                                        do_sample=args.sample, temperature=1.0, top_k=0, top_p=1.0,
                                        eos_token_id=tok.eos_id, pad_token_id=tok.eos_id, suppress_tokens=padding_ids,
                                        cache_implementation="static")
                synchronize()
                outputs["hf_static_compile"] = out[:, args.prompt :].cpu()
                return time.perf_counter() - start

            run_hf_fast(), run_hf_fast()  # compiles (and captures) for these shapes
            times = alternate({"ours": run_ours, "hf_static_compile": run_hf_fast}, args.rounds)
            row.update(hf_static_compile_s=times["hf_static_compile"], ours_vs_static_compile_s=times["ours"],
                       ratio_vs_hf_static_compile=median(times["hf_static_compile"]) / median(times["ours"]),
                       hf_static_compile_same_tokens=(bool(torch.equal(outputs["ours"], outputs["hf_static_compile"]))
                                                      if not args.sample else None))
            del fast
        row["identical_greedy_tokens"] = bool(torch.equal(outputs["ours"], outputs["hf"])) if not args.sample else None
        # How far the decode loop is from its kernels: HF's time over our prefill plus new-tokens steps
        # that ran only their matmuls and attention.
        floor = kernel_floor(ours.module, prompts, args.new_tokens)
        steps = args.new_tokens - 1  # the prefill gives the first new token, each decode step one more
        floor_s = floor["prefill_s"] + steps * floor["decode_step_s"]
        ours_s = median(row["ours_s"])
        row.update(prefill_ms=floor["prefill_s"] * 1e3, decode_floor_ms=floor["decode_step_s"] * 1e3,
                   ours_decode_step_ms=(ours_s - floor["prefill_s"]) / steps * 1e3,
                   ratio_at_floor=median(row["hf_s"]) / floor_s)
        # The memory floor: a step cannot beat reading its weights and cache at the measured bandwidth.
        step_bytes = weight_bytes_per_decode_step(ours.module) + floor["cache_bytes"]
        row.update(bytes_per_step=step_bytes, bandwidth_gbs=bandwidth,
                   bandwidth_floor_step_ms=step_bytes / (bandwidth * 1e9) * 1e3)
        row["share_of_bandwidth_floor"] = row["bandwidth_floor_step_ms"] / row["ours_decode_step_ms"]
        rows.append(row)
        del ours, hf
    print(f"\nGeneration, batch {args.batch}, prompt {args.prompt}, {args.new_tokens} new tokens, "
          f"{'sampling' if args.sample else 'greedy'}, {'bf16' if args.precision == 'bf16' else 'fp32'}, {device_description()}; "
          f"median of {args.rounds}")
    print(f"{'shape':<8} {'HF tok/s':>10} {'ours tok/s':>11} {'ratio':>7} {'same tokens':>12} "
          f"{'prefill ms':>11} {'decode step ms':>15} {'floor step ms':>14} {'ratio at floor':>15}")
    for r in rows:
        print(f"{r['shape']:<8} {r['hf_tok_s']:>10.0f} {r['ours_tok_s']:>11.0f} {r['ratio']:>7.2f} "
              f"{str(r['identical_greedy_tokens']):>12} {r['prefill_ms']:>11.0f} {r['ours_decode_step_ms']:>15.2f} "
              f"{r['decode_floor_ms']:>14.2f} {r['ratio_at_floor']:>15.2f}")
    for r in rows:
        print(f"{r['shape']:<8} bandwidth floor: {r['bytes_per_step'] / 1e6:.1f} MB a step at {r['bandwidth_gbs']:.0f} GB/s = "
              f"{r['bandwidth_floor_step_ms']:.3f} ms; our step reaches {100 * r['share_of_bandwidth_floor']:.0f}% of it"
              + (f"; ours / HF static cache + torch.compile: {r['ratio_vs_hf_static_compile']:.2f}x"
                 if "ratio_vs_hf_static_compile" in r else ""))
    print("decode step: ours, (median time - prefill) / (new tokens - 1); floor step: its matmuls and attention "
          "alone, cache at its mean length;\nratio at floor: HF's time over (prefill + (new tokens - 1) x floor step), "
          "about the most a decode loop on these kernels could reach (measured after the race: +- the VM's drift)")
    payload = {"benchmark": "generation", "machine": machine(), "args": vars(args), "rows": rows}
    name = "generation" + ("_sample" if args.sample else "") + ("_bf16" if args.precision == "bf16" else "") + \
        ("_cudagraphs" if args.cuda_graphs else "")
    print("written", write_json(name, payload))
    return payload


if __name__ == "__main__":
    main()
