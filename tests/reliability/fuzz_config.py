"""Config fuzzing: run the SFT, DPO and reward-model scripts with one hostile value per run (text
for a number, -1, NaN, 1e18, null, a list or a dict where one value belongs, ...) for keys drawn
at random from their shipped configs, on the built-in data and a tiny model, and report every run
that ended in a traceback or a hang instead of a one-line refusal or a finished run.

    python tests/reliability/fuzz_config.py                     # 200 runs, seed 0 (~15 min on 2 cores)
    python tests/reliability/fuzz_config.py --runs 50 --seed 3 --targets dpo rm

Prints each traceback's key, value and last lines, then the count of each outcome (``refused``:
exit 1 with one error line; ``accepted``: the run finished; ``TRACEBACK``; ``timeout``), and writes
them all as JSON with ``--json PATH``. Exit status 1 if any run ended in a traceback or a hang.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import random
import subprocess
import sys
import tempfile
from collections import Counter

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPTS = os.path.join(REPO, "examples", "nlp", "gpt")
sys.path.insert(0, REPO)
from omegaconf import OmegaConf  # noqa: E402

from nemo_aligner.data.nlp.builtin_task import BuiltinTask  # noqa: E402

# Keys whose values are paths the base command sets.
SKIPPED = ("file_path", "data_prefix", "restore_from_path", "explicit_log_dir")


def run(cmd, work, timeout_s):
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="offline")
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env, cwd=work)
        return p.returncode, p.stdout + p.stderr
    except subprocess.TimeoutExpired as e:
        text = lambda b: b.decode(errors="replace") if isinstance(b, bytes) else (b or "")
        return "timeout", text(e.stdout) + text(e.stderr)


class Targets:
    """The base command of each script: 2 steps on the built-in data (DPO and RM from a tiny SFT model)."""

    def __init__(self, work: str, timeout_s: float):
        self.work, self.timeout_s = work, timeout_s
        self.data = BuiltinTask(seed=0).write_all(os.path.join(work, "data"), n_train=64, n_val=16)
        self.sft_nemo = os.path.join(work, "sft", "checkpoints", "megatron_gpt_sft.nemo")
        rc, out = run(self.command("sft", os.path.join(work, "sft")), work, timeout_s)
        if rc != 0:
            raise SystemExit(f"the base SFT run failed:\n{out[-3000:]}")

    CONFIGS = {"sft": ("train_gpt_sft.py", "gpt_sft"), "dpo": ("train_gpt_dpo.py", "gpt_dpo"),
               "rm": ("train_reward_model.py", "training_rm")}

    def command(self, target: str, log_dir: str) -> list:
        d = self.data
        script = os.path.join(SCRIPTS, self.CONFIGS[target][0])
        common = [f"exp_manager.explicit_log_dir={log_dir}", "exp_manager.resume_if_exists=False"]
        if target == "sft":
            return [sys.executable, script, f"model.data.train_ds.file_path={d['sft_train']}",
                    f"model.data.validation_ds.file_path={d['sft_val']}", "trainer.sft.max_steps=2",
                    "trainer.sft.val_check_interval=2", "trainer.sft.limit_val_batches=1"] + common
        split = {"dpo": ("dpo_train", "dpo_val"), "rm": ("rm_train", "rm_val")}[target]
        prefix = f"{{train: [{d[split[0]]}], validation: [{d[split[1]]}], test: [{d[split[1]]}]}}"
        return [sys.executable, script, f"pretrained_checkpoint.restore_from_path={self.sft_nemo}",
                f"++model.data.data_prefix={prefix}", f"trainer.{target}.max_steps=2",
                f"trainer.{target}.val_check_interval=2", f"trainer.{target}.limit_val_batches=1",
                "model.global_batch_size=4", "model.micro_batch_size=1"] + common


def leaves(cfg) -> list:
    """``(dotted path, shipped value)`` of every leaf (interpolations unresolved)."""
    out = []

    def walk(node, prefix):
        if OmegaConf.is_dict(node):
            for key in node.keys():
                walk(node._get_node(key), f"{prefix}.{key}" if prefix else str(key))
        else:
            value = OmegaConf.to_container(node) if OmegaConf.is_list(node) else node._value()
            out.append((prefix, value))

    walk(cfg, "")
    return out


def hostile_values(default) -> list:
    if isinstance(default, bool):
        return ["abc", "2", "null", "[true]"]
    if isinstance(default, (int, float)):
        return ["abc", "-1", "nan", "1e18", "null", "[1]", "{x: 1}"]
    if isinstance(default, str):
        return ["null", "''", "[1]", "{x: 1}", "-5"]
    if isinstance(default, list):
        return ["abc", "[]", "[[1]]", "{x: 1}"]
    return ["abc", "-1", "[1]", "{x: 1}"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--targets", nargs="+", default=list(Targets.CONFIGS), choices=list(Targets.CONFIGS))
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--timeout-s", type=float, default=300)
    parser.add_argument("--json", help="write every run's outcome here")
    args = parser.parse_args(argv)

    work = tempfile.mkdtemp(prefix="fuzz_config_")
    targets = Targets(work, args.timeout_s)
    cases = []
    for target in args.targets:
        shipped = OmegaConf.load(os.path.join(SCRIPTS, "conf", Targets.CONFIGS[target][1] + ".yaml"))
        for key, default in leaves(shipped):
            if not any(s in key for s in SKIPPED):
                cases += [(target, key, value) for value in hostile_values(default)]
    random.Random(args.seed).shuffle(cases)
    cases = list(enumerate(cases[: args.runs]))

    def one(case):
        i, (target, key, value) = case
        rc, out = run(targets.command(target, os.path.join(work, "runs", str(i))) + [f"++{key}={value}"], work,
                      args.timeout_s)
        lines = [line for line in out.strip().splitlines() if line.strip()]
        traceback = "Traceback (most recent call last)" in out
        verdict = "timeout" if rc == "timeout" else "accepted" if rc == 0 else "TRACEBACK" if traceback else "refused"
        return {"target": target, "key": key, "value": value, "verdict": verdict,
                "last_lines": lines[-12:] if verdict in ("TRACEBACK", "timeout") else lines[-1:]}

    results = []
    with concurrent.futures.ThreadPoolExecutor(args.workers) as pool:
        for result in pool.map(one, cases):
            results.append(result)
            if result["verdict"] in ("TRACEBACK", "timeout"):
                print(f"== {result['verdict']}: {result['target']} {result['key']}={result['value']}\n"
                      + "\n".join(result["last_lines"]) + "\n", flush=True)
    counts = Counter(r["verdict"] for r in results)
    print(", ".join(f"{k}: {v}" for k, v in sorted(counts.items())))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=1)
    return 1 if counts["TRACEBACK"] or counts["timeout"] else 0


if __name__ == "__main__":
    sys.exit(main())
