"""``make demo``: the built-in task end to end on a tiny model, on the CPU, in a few minutes.

Writes the built-in data, fine-tunes a randomly initialised tiny GPT with the SFT
script exactly as a user would run it, and prints how the loss fell and where the
.nemo was written.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys

from nemo_aligner.data.nlp.builtin_task import BuiltinTask

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(REPO, "examples", "nlp", "gpt")


def run(script: str, overrides: list) -> None:
    cmd = [sys.executable, os.path.join(SCRIPTS, script)] + overrides
    print("\n$ " + " ".join(cmd[1:]), flush=True)
    subprocess.run(cmd, check=True)


def loss_table(metrics_path: str) -> list:
    """``(step, train loss, validation loss)`` at each validation."""
    train, rows = {}, []
    with open(metrics_path, encoding="utf-8") as f:
        for line in f:
            record = json.loads(line)
            if "train/loss" in record:
                train[record["step"]] = record["train/loss"]
            if "val/loss" in record:
                rows.append((record["step"], train.get(record["step"]), record["val/loss"]))
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out-dir", default="demo_results")
    parser.add_argument("--sft-steps", type=int, default=300)
    args = parser.parse_args(argv)
    out = os.path.abspath(args.out_dir)
    data = os.path.join(out, "data")
    paths = BuiltinTask(seed=0).write_all(data, n_train=2000, n_val=200)
    print(f"built-in data written to {data}")

    sft_dir = os.path.join(out, "sft")
    shutil.rmtree(sft_dir, ignore_errors=True)  # a fresh run each time (metrics.jsonl appends)
    run("train_gpt_sft.py", [
        f"model.data.train_ds.file_path={paths['sft_train']}",
        f"model.data.validation_ds.file_path={paths['sft_val']}",
        f"trainer.sft.max_steps={args.sft_steps}",
        "trainer.sft.max_epochs=100",
        f"trainer.sft.val_check_interval={max(args.sft_steps // 6, 1)}",
        f"exp_manager.explicit_log_dir={sft_dir}",
        "exp_manager.resume_if_exists=False",
    ])
    rows = loss_table(os.path.join(sft_dir, "metrics.jsonl"))
    print("\nSFT on the built-in task (tiny GPT, random init):")
    print(f"{'step':>6} {'train loss':>11} {'val loss':>9}")
    for step, train, val in rows:
        print(f"{step:>6} {train if train is not None else float('nan'):>11.4f} {val:>9.4f}")
    nemo = os.path.join(sft_dir, "checkpoints", "megatron_gpt_sft.nemo")
    first, last = rows[0][2], rows[-1][2]
    print(f"\nvalidation loss {first:.3f} -> {last:.3f}; fine-tuned model: {nemo}")


if __name__ == "__main__":
    main()
