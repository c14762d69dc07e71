"""Config fuzzing: run the training, generation and top-k logits scripts with one hostile value per
run (text for a number, -1, NaN, 1e18, null, a list or a dict where one value belongs, ...) for keys
drawn at random from their shipped configs, on the built-in data and a tiny model, and report every run
that ended in a traceback or a hang instead of a one-line refusal or a finished run.

    python tests/reliability/fuzz_config.py                     # 200 runs, seed 0, every script (~10 min on 2 cores)
    python tests/reliability/fuzz_config.py --runs 50 --seed 3 --targets dpo rm grpo

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
import shutil
import subprocess
import sys
import tempfile
from collections import Counter

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPTS = os.path.join(REPO, "examples", "nlp", "gpt")
sys.path.insert(0, REPO)
from omegaconf import OmegaConf  # noqa: E402

from nemo_aligner.data.nlp.builtin_task import BuiltinTask  # noqa: E402
from nemo_aligner.demo import tiny_batch  # noqa: E402

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


def check_base(name: str, cmd: list, work: str, timeout_s: float) -> None:
    """Run a target's unchanged command once: one that fails would make every fuzzed run look "refused"."""
    rc, out = run(cmd, work, timeout_s)
    if rc != 0:
        raise SystemExit(f"the base {name} run failed:\n{out[-3000:]}")


def tokenizer_directory(path: str) -> str:
    """A tiny word-level Hugging Face tokenizer saved in ``path`` (no download)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<unk>", "<s>", "</s>", "sort", "ab", "ba"])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(path)
    return path


class Targets:
    """The base command of each script: 2 steps on the built-in data (all but SFT from a tiny SFT model)."""

    CONFIGS = {"sft": ("train_gpt_sft.py", "gpt_sft"), "dpo": ("train_gpt_dpo.py", "gpt_dpo"),
               "rm": ("train_reward_model.py", "training_rm"), "kto": ("train_gpt_kto.py", "gpt_kto"),
               "spin": ("train_gpt_spin.py", "gpt_spin"), "steerlm": ("train_steerlm_model.py", "gpt_steerlm"),
               "grpo": ("train_gpt_grpo.py", "gpt_grpo"), "reinforce": ("train_gpt_reinforce_actor.py", "gpt_reinforce_actor"),
               "rs": ("train_gpt_rs_actor.py", "gpt_rs_actor"), "generate": ("generate_gpt.py", "gpt_generate"),
               "kd": ("train_gpt_knowledge_distillation.py", "gpt_knowledge_distillation"),
               "topk": ("../synthetic_data_gen/compute_topk_logits.py",
                        "../../synthetic_data_gen/conf/compute_topk_logits")}

    # The data files each script reads: (training, validation) keys of ``BuiltinTask.write_all``'s paths.
    DATA_FILES = {"sft": ("sft_train", "sft_val"), "spin": ("sft_train", "sft_val"),
                  "steerlm": ("steerlm_train", "steerlm_val"), "dpo": ("dpo_train", "dpo_val"),
                  "rm": ("rm_train", "rm_val"), "kto": ("kto_train", "kto_val"),
                  "grpo": ("prompts_train", "prompts_val"), "reinforce": ("prompts_train", "prompts_val"),
                  "rs": ("prompts_train", "prompts_val"), "generate": ("prompts_val", "prompts_val"),
                  "kd": ("kd_train", "kd_val"), "topk": ("sft_val", "sft_val")}

    # Extra overrides of the base SFT run (fuzz_checkpoint.py --moe: a mixture-of-experts model).
    SFT_EXTRA: list = []

    def __init__(self, work: str, timeout_s: float):
        self.work, self.timeout_s = work, timeout_s
        self.data = BuiltinTask(seed=0).write_all(os.path.join(work, "data"), n_train=64, n_val=16)
        self.checked = set()
        self.sft_nemo = os.path.join(work, "base", "sft", "checkpoints", "megatron_gpt_sft.nemo")
        self.check_bases(["sft"])  # its .nemo is the others' starting point

    def teacher_records(self) -> None:
        """Knowledge distillation's data: the SFT model's top-4 logits over the SFT data."""
        if "kd_train" in self.data:
            return
        for split in ("train", "val"):
            out = os.path.join(self.work, "data", f"kd_{split}.jsonl")
            cmd = self.topk_command(self.data[f"sft_{split}"], out)
            rc, text = run(cmd, self.work, self.timeout_s)
            if rc != 0:
                raise SystemExit(f"computing the teacher's top-k logits failed:\n{text[-3000:]}")
            self.data[f"kd_{split}"] = out

    def topk_command(self, data_file: str, output: str) -> list:
        return [sys.executable, os.path.join(SCRIPTS, self.CONFIGS["topk"][0]),
                f"pretrained_checkpoint.restore_from_path={self.sft_nemo}", f"data.data.file_path={data_file}",
                f"output_path={output}", "top_k=4", "model.global_batch_size=16", "model.micro_batch_size=8"]

    def check_bases(self, targets) -> None:
        """Run each target's base command once: one that fails would make every fuzzed run look "refused"."""
        for target in targets:
            if target in self.checked:
                continue
            if target == "kd":
                self.teacher_records()
            check_base(target, self.command(target, os.path.join(self.work, "base", target)), self.work, self.timeout_s)
            self.checked.add(target)

    def command(self, target: str, log_dir: str) -> list:
        train, val = (self.data[key] for key in self.DATA_FILES[target])
        nemo = self.sft_nemo
        script = os.path.join(SCRIPTS, self.CONFIGS[target][0])
        if target == "topk":
            os.makedirs(log_dir, exist_ok=True)
            return self.topk_command(val, os.path.join(log_dir, "topk.jsonl"))
        if target == "generate":
            return [sys.executable, script, f"gpt_model_file={nemo}", f"prompts_file={val}",
                    f"output_file={os.path.join(log_dir, 'out.jsonl')}", "inference.tokens_to_generate=4",
                    "batch_size=8"]
        section = {"steerlm": "sft", "kd": "knowledge_distillation"}.get(target, target)
        common = [f"exp_manager.explicit_log_dir={log_dir}", "exp_manager.resume_if_exists=False",
                  f"trainer.{section}.max_steps=2", f"trainer.{section}.val_check_interval=2"]
        if target not in ("grpo", "reinforce", "rs"):  # these validate on num_val_samples prompts
            common.append(f"trainer.{section}.limit_val_batches=1")
        if target in ("sft", "spin", "steerlm"):
            files = [f"model.data.train_ds.file_path={train}", f"model.data.validation_ds.file_path={val}"]
            restore = {"sft": [], "steerlm": [f"model.restore_from_path={nemo}"],
                       "spin": [f"pretrained_checkpoint.restore_from_path={nemo}", "trainer.spin.max_iterations=1",
                                "model.data.chat=False",
                                "model.global_batch_size=8", "model.micro_batch_size=4",
                                "model.spin.rollout_micro_batch_size=8", "model.spin.length_params.max_length=4"]}
            extra = self.SFT_EXTRA if target == "sft" else []
            return [sys.executable, script] + tiny_batch(script) + restore[target] + files + common + extra
        prefix = f"{{train: [{train}], validation: [{val}], test: [{val}]}}"
        base = [sys.executable, script, f"pretrained_checkpoint.restore_from_path={nemo}",
                f"++model.data.data_prefix={prefix}"] + common
        if target == "kd":
            return base + ["model.global_batch_size=8", "model.micro_batch_size=4"]
        if target in ("dpo", "rm", "kto"):
            return base + ["model.global_batch_size=4", "model.micro_batch_size=1"]
        counts = {"grpo": ["num_responses_per_prompt=2"],
                  "reinforce": ["num_responses_per_prompt=2", "rollout_micro_batch_size=4"],
                  "rs": ["num_rollouts_per_prompt=2", "top_n_rollouts=1", "rollout_micro_batch_size=4"]}[target]
        rollout = [f"model.{target}.{s}" for s in ["num_rollout_samples=4", "num_val_samples=4",
                                                   "length_params.max_length=4"] + counts]
        return base + rollout + ["reward_fn=nemo_aligner.data.nlp.builtin_task:reward", "model.global_batch_size=4",
                                 "model.micro_batch_size=2"]


def arguments(doc: str, runs: int, targets: list) -> argparse.ArgumentParser:
    """The fuzzers' command line: --runs, --seed, --targets, --workers, --timeout-s, --json."""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("--runs", type=int, default=runs)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--targets", nargs="+", default=targets, choices=targets)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--timeout-s", type=float, default=300)
    parser.add_argument("--json", help="write every run's outcome here")
    parser.add_argument("--keep", action="store_true",
                        help="keep the work directory (kept anyway when a run failed)")
    return parser


def finished(work: str, status: int, keep: bool) -> int:
    """Remove the work directory (hundreds of MB) unless asked to keep it or a run failed; returns
    ``status``."""
    if status or keep:
        print(f"work directory: {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)
    return status


def prepared(args, prefix: str):
    """A fresh work directory and the Targets in it (built-in data, the base SFT model), each of
    ``args.targets``' base commands checked."""
    work = tempfile.mkdtemp(prefix=prefix)
    targets = Targets(work, args.timeout_s)
    targets.check_bases(args.targets)
    return work, targets


def outcome(rc, out: str) -> dict:
    """One run's verdict (refused, accepted, TRACEBACK, timeout) and its last output lines."""
    lines = [line for line in out.strip().splitlines() if line.strip()]
    traceback = "Traceback (most recent call last)" in out
    verdict = "timeout" if rc == "timeout" else "accepted" if rc == 0 else "TRACEBACK" if traceback else "refused"
    return {"verdict": verdict, "last_lines": lines[-12:] if verdict in ("TRACEBACK", "timeout") else lines[-1:]}


def run_all(cases, one, workers: int, json_path, title, failures=("TRACEBACK", "timeout")) -> int:
    """``one(case)`` for every case on ``workers`` threads; prints each run whose verdict is one of
    ``failures`` (``title(result)`` names it), then the count of each outcome; writes them all to
    ``json_path``. Exit status 1 if any run's verdict is one of ``failures``."""
    results = []
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        for result in pool.map(one, cases):
            results.append(result)
            if result["verdict"] in failures:
                print(f"== {result['verdict']}: {title(result)}\n" + "\n".join(result["last_lines"]) + "\n", flush=True)
    counts = Counter(r["verdict"] for r in results)
    print(", ".join(f"{k}: {v}" for k, v in sorted(counts.items())))
    if json_path:
        with open(json_path, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=1)
    return 1 if any(counts[f] for f in failures) else 0


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
    args = arguments(__doc__, 200, list(Targets.CONFIGS)).parse_args(argv)
    work, targets = prepared(args, "fuzz_config_")
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
        return {"target": target, "key": key, "value": value, **outcome(rc, out)}

    return finished(work, run_all(cases, one, args.workers, args.json,
                                  lambda r: f"{r['target']} {r['key']}={r['value']}"), args.keep)

if __name__ == "__main__":
    sys.exit(main())
