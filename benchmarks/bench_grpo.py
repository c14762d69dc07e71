"""GRPO step time and its phases, ours vs TRL's ``GRPOTrainer`` on the same model (identical
weights), prompts, group size and lengths, in one process. Needs ``pip install trl`` (the
``[bench]`` extra).

    python benchmarks/bench_grpo.py [--shape tiny] [--prompts 8] [--generations 8] [--steps 4]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import torch

from common import build_pair, init_single_process, machine, write_json


def byte_tokenizer_dir(path: str) -> str:
    """A Hugging Face tokenizer with our byte tokenizer's ids (byte b -> id b, then the specials)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from nemo_aligner.utils.tokenizers import BYTE_SPECIAL_TOKENS

    vocab = {ch: b for b, ch in enumerate(_bytes_to_unicode())}
    vocab.update({tok: 256 + i for i, tok in enumerate(BYTE_SPECIAL_TOKENS)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>")
    fast.save_pretrained(path)
    return path


def _bytes_to_unicode():
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    table = dict(zip(bs, (chr(c) for c in cs)))
    return [table[b] for b in range(256)]


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="tiny")
    parser.add_argument("--prompts", type=int, default=8, help="prompts per step")
    parser.add_argument("--generations", type=int, default=8, help="responses per prompt")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args(argv)

    try:
        import trl
    except ImportError:
        raise SystemExit("bench_grpo.py needs TRL: pip install trl (or pip install -e .[bench])")
    from datasets import Dataset

    from nemo_aligner.data.nlp.builtin_task import BuiltinTask

    init_single_process()
    work = tempfile.mkdtemp(prefix="bench_grpo_")
    ours, hf = build_pair(args.shape, 128)
    prompts = [BuiltinTask.prompt_text(i) for i, _ in BuiltinTask(seed=0).examples(args.prompts * (args.steps + 2))]
    rollouts = args.prompts * args.generations

    def reward(prompt: str, response: str) -> float:
        return BuiltinTask.score(prompt, response)

    # ---- TRL
    tok_dir = byte_tokenizer_dir(os.path.join(work, "tok"))
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    config = trl.GRPOConfig(output_dir=os.path.join(work, "trl"), per_device_train_batch_size=rollouts,
                            num_generations=args.generations, max_completion_length=args.new_tokens,
                            learning_rate=1e-6, max_steps=args.steps, logging_steps=1, report_to=[], use_cpu=True,
                            bf16=False, beta=0.01, save_strategy="no", gradient_accumulation_steps=1,
                            temperature=1.0, dataloader_num_workers=0, seed=0)

    def trl_reward(prompts, completions, **kwargs):
        return [reward(p, c) for p, c in zip(prompts, completions)]

    trainer = trl.GRPOTrainer(model=hf, reward_funcs=trl_reward, args=config, processing_class=tokenizer,
                              train_dataset=Dataset.from_list([{"prompt": p} for p in prompts]))
    start = time.perf_counter()
    trainer.train()
    trl_step = (time.perf_counter() - start) / args.steps

    # ---- ours (the same weights: build_pair gave both the same initialisation)
    from nemo_aligner.algorithms.reinforce import ReinforceTrainer  # noqa: F401  (the loop timed below)
    from nemo_aligner.trainers.grpo import GRPOTrainer

    nemo = os.path.join(work, "ours.nemo")
    from nemo_aligner.utils.nemo_file import save_nemo

    save_nemo(ours, nemo)
    phases = {}

    from nemo_aligner.trainers.callbacks import Callback

    class Phases(Callback):
        def on_step_end(self, trainer, step, metrics):
            if step > 1:  # the first step includes start-up work
                for k, v in metrics.items():
                    if k.startswith("time/"):
                        phases.setdefault(k[5:], []).append(v)

    api = GRPOTrainer.from_pretrained(nemo, num_prompts_per_step=args.prompts, num_generations_per_prompt=args.generations,
                                      learning_rate=1e-6, max_sequence_length=128, max_new_tokens=args.new_tokens,
                                      global_batch_size=rollouts, micro_batch_size=min(rollouts, 16),
                                      output_dir=os.path.join(work, "ours"),
                                      overrides={"trainer.grpo.val_at_start": False,
                                                 "model.grpo.length_params.min_length": args.new_tokens})
    api.fit(dataset=prompts, reward_fn=reward, max_steps=args.steps + 1, callbacks=[Phases()])
    ours_step = sum(phases["step"]) / len(phases["step"])
    row = {"shape": args.shape, "rollouts_per_step": rollouts, "trl_step_s": trl_step, "ours_step_s": ours_step,
           "ratio": ours_step / trl_step, "ours_phases_s": {k: sum(v) / len(v) for k, v in phases.items()}}
    print(f"\nGRPO step, {args.prompts} prompts x {args.generations} responses, up to {args.new_tokens} new tokens, "
          f"{args.shape} model, fp32, {torch.get_num_threads()} threads")
    print(f"TRL {trl.__version__}: {trl_step:.2f} s/step; ours: {ours_step:.2f} s/step; ratio {row['ratio']:.2f}")
    print("ours by phase: " + ", ".join(f"{k} {v:.2f}s" for k, v in row["ours_phases_s"].items()))
    payload = {"benchmark": "grpo", "machine": machine(), "args": vars(args), "trl_version": trl.__version__,
               "rows": [row]}
    print("written", write_json("grpo", payload))
    return payload


if __name__ == "__main__":
    main()
