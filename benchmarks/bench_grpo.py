"""GRPO step time and its phases, ours vs TRL's ``GRPOTrainer`` on the same model (identical
weights), prompts, group size and lengths, in one process. Needs TRL, which cannot live in the
project's venv (TRL's datasets/pyarrow/pandas need numpy>=2, nvidia-pytriton pins numpy<2): build
the separate venv with ``make bench-venv`` (pins in ``benchmarks/requirements-trl.txt``), then

    cd benchmarks && ../.venv-bench/bin/python bench_grpo.py [--shape tiny] [--prompts 8] [--generations 8] [--steps 4] [--rounds 3]
        [--prompt-prefix-tokens N] [--override KEY=VALUE ...] [--precision 32|bf16]

Both sides: fp32 on the CPU; on a GPU, bf16 (ours: bf16 weights, float32 master weights in the
optimizer; TRL: float32 weights under bf16 autocast, ``bf16=True``, as HF's Trainer runs); no vLLM;
the same prompts, group size, learning rate (constant) and KL coefficient (0.01); exactly
``--new-tokens`` new tokens per response (EOS refused before that; our end strings off, TRL
``min_new_tokens``); vocabulary padding rows never sampled; all of a step's rollouts generated in
one batch; the same micro-batch for training and for the reference log-prob pass; one optimizer step
per GRPO step; no activation checkpointing (TRL enables it by default).
Times are per step, averaged over ``--steps`` steps after one warm-up step on each side, in ``--rounds``
alternating runs of each side; the ratio is the median of the rounds' ratios.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics

import torch

from common import (build_pair, byte_tokenizer_dir, default_precision, device_description, init_single_process,
                    machine, scratch_dir, trainer_step_timer, write_json)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="tiny")
    parser.add_argument("--prompts", type=int, default=8, help="prompts per step")
    parser.add_argument("--generations", type=int, default=8, help="responses per prompt")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--steps", type=int, default=4, help="timed steps per run (after one warm-up step)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating runs of each side")
    parser.add_argument("--prompt-prefix-tokens", type=int, default=0,
                        help="a fixed instruction of this many tokens before every prompt (longer prompts, "
                             "same task and reward)")
    parser.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                        help="config override for ours (repeatable), e.g. model.grpo.share_prompt_prefix=false")
    parser.add_argument("--precision", choices=["32", "bf16"], default=default_precision(),
                        help="bf16 on a GPU, 32 on the CPU by default (both sides)")
    args = parser.parse_args(argv)

    try:
        import trl
        from datasets import Dataset
    except ImportError:
        raise SystemExit("bench_grpo.py needs TRL and datasets: make bench-venv, then run it with .venv-bench/bin/python")

    from nemo_aligner.data.nlp.builtin_task import BuiltinTask

    on_gpu = torch.cuda.is_available()
    bf16 = args.precision == "bf16"
    init_single_process()
    work = scratch_dir("bench_grpo_")
    context = 128 + args.prompt_prefix_tokens
    ours, hf = build_pair(args.shape, context, precision=args.precision)
    # The byte tokenizer makes one token of each ASCII character.
    prefix = ("Instruction: answer the task below with its result only, nothing else. " * 64)[: args.prompt_prefix_tokens]
    prompts = [prefix + BuiltinTask.prompt_text(i)
               for i, _ in BuiltinTask(seed=0).examples(args.prompts * (args.steps + 2))]
    rollouts = args.prompts * args.generations
    micro = math.gcd(rollouts, 16)  # the training micro-batch, both sides

    def reward(prompt: str, response: str) -> float:
        return BuiltinTask.score(prompt[len(prefix):], response)

    # ---- TRL. GRPOTrainer builds its reference model from the policy's path, so it gets the HF weights
    # from a directory (policy and reference both load them: the same weights as ours).
    hf_dir = os.path.join(work, "hf")
    hf.save_pretrained(hf_dir)
    from nemo_aligner.utils.tokenizers import ByteTokenizer

    vocab = ByteTokenizer().vocab_size  # rows past it are padding: never sampled (ours masks them too)
    padded_vocab = hf.config.vocab_size
    del hf
    tok_dir = byte_tokenizer_dir(hf_dir)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    # One optimizer step per GRPO step: the step's rollouts are generated in one batch
    # (generation_batch_size = micro batch x accumulation) and trained in micro-batches of `micro`.
    def trl_config(run: int):
        return trl.GRPOConfig(output_dir=os.path.join(work, f"trl{run}"), per_device_train_batch_size=micro,
                              gradient_accumulation_steps=rollouts // micro, num_generations=args.generations,
                              max_completion_length=args.new_tokens,
                              generation_kwargs={"min_new_tokens": args.new_tokens,  # as our min_length
                                                 "suppress_tokens": list(range(vocab, padded_vocab))},
                              learning_rate=1e-6, lr_scheduler_type="constant", max_steps=args.steps + 1,
                              logging_steps=1, report_to="none", use_cpu=not on_gpu, bf16=bf16, fp16=False, beta=0.01,
                              save_strategy="no", temperature=1.0, dataloader_num_workers=0, seed=0,
                              # TRL turns activation checkpointing on by default (it recomputes the
                              # forward in backward); ours does not recompute, so neither does TRL here
                              gradient_checkpointing=False,
                              model_init_kwargs={"dtype": "float32"})

    def trl_reward(prompts, completions, **kwargs):
        return [reward(p, c) for p, c in zip(prompts, completions)]

    # TRL times its phases (generate, logprobs, loss, rewards) with ProfilingContext, which only reports
    # them to wandb/mlflow/trackio: catch them here, by step, to report TRL's phases too.
    from trl.extras import profiling

    def run_trl(run: int):
        """One TRL training run: its step times after the first, phases per step, response lengths."""
        blocks = []  # (step index, block name, seconds)
        timer = trainer_step_timer()  # each step: generation, scoring, logprobs, forward/backward, update
        original_log = profiling.ProfilingContext._log_metrics

        def record(context, duration):
            blocks.append((len(timer.seconds), context.name.split(".", 1)[-1], duration))
            original_log(context, duration)

        profiling.ProfilingContext._log_metrics = record
        trainer = trl.GRPOTrainer(model=hf_dir, reward_funcs=trl_reward, args=trl_config(run), processing_class=tokenizer,
                                  train_dataset=Dataset.from_list([{"prompt": p} for p in prompts]),
                                  callbacks=[timer])
        try:
            trainer.train()
        finally:
            profiling.ProfilingContext._log_metrics = original_log
        timed = timer.seconds[1:]  # the first step includes start-up work
        phases = {}
        for step, name, seconds in blocks:
            if step >= 1:
                phases[name] = phases.get(name, 0.0) + seconds / len(timed)
        lengths = [float(h["completions/mean_length"]) for h in trainer.state.log_history
                   if "completions/mean_length" in h][1:]
        return timed, phases, lengths

    # ---- ours (the same weights: build_pair gave both the same initialisation)
    from nemo_aligner.algorithms.callbacks import Callback
    from nemo_aligner.trainers.grpo import GRPOTrainer
    from nemo_aligner.utils.nemo_file import save_nemo

    nemo = os.path.join(work, "ours.nemo")
    save_nemo(ours, nemo)

    import yaml

    overrides = {}
    for item in args.override:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--override {item!r}: expected KEY=VALUE")
        overrides[key] = yaml.safe_load(value)  # typed as on a Hydra command line

    def run_ours(run: int):
        """One run of ours: its step times after the first, phases per step, response lengths."""
        phases, lengths = {}, []

        class Phases(Callback):
            def on_step_end(self, trainer, step, metrics):
                if step > 1:  # the first step includes start-up work
                    lengths.append(metrics.get("response_length", float("nan")))
                    for k, v in metrics.items():
                        if k.startswith("time/"):
                            phases.setdefault(k[5:], []).append(v)

        api = GRPOTrainer.from_pretrained(nemo, num_prompts_per_step=args.prompts,
                                          num_generations_per_prompt=args.generations, learning_rate=1e-6,
                                          max_sequence_length=context, max_new_tokens=args.new_tokens,
                                          global_batch_size=rollouts, micro_batch_size=micro,
                                          rollout_micro_batch_size=rollouts, kl_penalty=0.01, temperature=1.0,
                                          output_dir=os.path.join(work, f"ours{run}"), precision=args.precision,
                                          overrides={"trainer.grpo.val_at_start": False,
                                                     "model.grpo.length_params.min_length": args.new_tokens,
                                                     # TRL stops only at EOS: no end strings, so every
                                                     # response has exactly --new-tokens tokens on both sides
                                                     "model.grpo.sampling_params.end_strings": [],
                                                     # TRL's log-prob passes run in training micro-batches
                                                     "model.grpo.forward_micro_batch_size": micro,
                                                     **overrides})
        api.fit(dataset=prompts, reward_fn=reward, max_steps=args.steps + 1, callbacks=[Phases()])
        return phases.pop("step"), {k: sum(v) / len(v) for k, v in phases.items()}, lengths

    # Alternate whole runs: this shared VM's speed drifts by ~10% within minutes, so each round's
    # ratio compares runs that were minutes apart at most.
    rounds = []
    for run in range(args.rounds):
        trl_steps, trl_phases, trl_lengths = run_trl(run)
        ours_steps, ours_phases, lengths = run_ours(run)
        rounds.append({"trl_steps_s": trl_steps, "ours_steps_s": ours_steps, "trl_profiled_blocks_s": trl_phases,
                       "ours_phases_s": ours_phases, "trl_lengths": trl_lengths, "ours_lengths": lengths,
                       "ratio": statistics.mean(ours_steps) / statistics.mean(trl_steps)})
    trl_step = statistics.median(statistics.mean(r["trl_steps_s"]) for r in rounds)
    ours_step = statistics.median(statistics.mean(r["ours_steps_s"]) for r in rounds)
    mean_of = lambda key: {k: statistics.mean(r[key][k] for r in rounds) for k in rounds[0][key]}
    all_of = lambda key: [x for r in rounds for x in r[key]]
    row = {"shape": args.shape, "rollouts_per_step": rollouts, "mean_prompt_tokens": statistics.mean(len(p) for p in prompts), "micro_batch": micro, "trl_step_s": trl_step,
           "ours_step_s": ours_step, "ratio": statistics.median(r["ratio"] for r in rounds),
           "round_ratios": [r["ratio"] for r in rounds], "trl_steps_s": all_of("trl_steps_s"),
           "ours_steps_s": all_of("ours_steps_s"), "ours_phases_s": mean_of("ours_phases_s"),
           "trl_profiled_blocks_s": mean_of("trl_profiled_blocks_s"),
           "mean_new_tokens": {"trl": statistics.mean(all_of("trl_lengths") or [float("nan")]),
                               "ours": statistics.mean(all_of("ours_lengths") or [float("nan")])}}
    trl_phases = row["trl_profiled_blocks_s"]
    prompt_tokens = statistics.mean(len(p) for p in prompts)  # bytes: one token each
    print(f"\nGRPO step, {args.prompts} prompts (~{prompt_tokens:.0f} tokens) x {args.generations} responses, "
          f"up to {args.new_tokens} new tokens, {args.shape} model, {'bf16' if bf16 else 'fp32'}, "
          f"{device_description()}")
    print(f"TRL {trl.__version__}: {trl_step:.2f} s/step; ours: {ours_step:.2f} s/step; "
          f"ratio (ours/TRL time, median of {args.rounds} alternating rounds) {row['ratio']:.2f} "
          f"(rounds: {', '.join(f'{r:.2f}' for r in row['round_ratios'])})")
    print(f"mean new tokens per response: TRL {row['mean_new_tokens']['trl']:.1f}, "
          f"ours {row['mean_new_tokens']['ours']:.1f}")
    print("ours by phase: " + ", ".join(f"{k} {v:.2f}s" for k, v in row["ours_phases_s"].items()))
    print("TRL profiled blocks per step (nested, they overlap): "
          + ", ".join(f"{k} {v:.2f}s" for k, v in sorted(trl_phases.items())))
    payload = {"benchmark": "grpo", "machine": machine(), "args": vars(args), "trl_version": trl.__version__,
               "rows": [row]}
    print("written", write_json("grpo" + ("_bf16" if bf16 else ""), payload))
    return payload


if __name__ == "__main__":
    main()
