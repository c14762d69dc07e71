"""The Python API: the README snippet on a tiny local model, callbacks, results and checkpoints,
SFT/DPO trainers, the registry, the nemo_rl alias, and clear errors."""

import json
import os
import re

import pytest

from conftest import REPO, read_metrics, subprocess_env
from nemo_aligner.utils.errors import AlignerError, ConfigError


@pytest.fixture(scope="module")
def weak_sft(tmp_path_factory, weak_policy):
    """The partly trained policy (150 SFT steps), the built-in data and a scratch directory."""
    model, data = weak_policy
    return tmp_path_factory.mktemp("api"), data, model


@pytest.mark.learning
def test_grpo_snippet_raises_reward_with_callbacks(weak_sft):
    from nemo_aligner import GRPOTrainer
    from nemo_aligner.data.nlp.builtin_task import BuiltinTask
    from nemo_aligner.trainers.callbacks import Callback

    out, data, model = weak_sft
    events = []

    class Recorder(Callback):
        def on_train_begin(self, trainer):
            events.append(("begin", trainer.current_step))

        def on_step_begin(self, trainer, step):
            events.append(("step_begin", step))

        def on_step_end(self, trainer, step, metrics):
            events.append(("step_end", step, metrics["rewards"]))

        def on_epoch_end(self, trainer, epoch):
            events.append(("epoch_end", epoch))

        def on_train_end(self, trainer, result):
            events.append(("end",))

    trainer = GRPOTrainer.from_pretrained(model, num_prompts_per_step=16, num_generations_per_prompt=8,
                                          learning_rate=5e-5, max_sequence_length=64, max_new_tokens=9,
                                          global_batch_size=64, micro_batch_size=16, output_dir=str(out / "grpo"))

    def reward_fn(prompt: str, response: str) -> float:
        return BuiltinTask.score(prompt, response)

    result = trainer.fit(dataset=data["prompts_train"], val_dataset=data["prompts_val"], reward_fn=reward_fn,
                         max_steps=80, callbacks=[Recorder()])
    print(result.metrics, result.best_checkpoint_path, result.total_steps, result.total_epochs)
    steps = [e[1] for e in events if e[0] == "step_begin"]
    assert events[0] == ("begin", 0) and events[-1] == ("end",) and steps == list(range(1, 81))
    order = [e[0] for e in events if e[0] in ("step_begin", "step_end")]
    assert order == ["step_begin", "step_end"] * 80
    assert result.total_steps == 80 == trainer.current_step and result.total_epochs == 1
    # 1000 prompts, 16 a step: the first epoch ends with step 62
    at = events.index(("epoch_end", 0))
    assert events[at - 1][:2] == ("step_end", 62) and [e for e in events if e[0] == "epoch_end"] == [("epoch_end", 0)]
    # mean sampled reward (128 responses a step) of the first and last 20 steps, and the greedy
    # reward on the 64 held-out prompts before the first step and after the last
    rewards = [e[2] for e in events if e[0] == "step_end"]
    first, last = sum(rewards[:20]) / 20, sum(rewards[-20:]) / 20
    val = [json.loads(line) for line in open(out / "grpo" / "fit_1" / "metrics.jsonl") if "val/global_rewards" in line]
    before, after = val[0]["val/global_rewards"], val[-1]["val/global_rewards"]
    print(f"GRPO sampled reward {first:.3f} -> {last:.3f}; greedy validation reward {before:.3f} -> {after:.3f}")
    assert last > first + 0.02, (first, last)
    # GRPO raises the sampled reward it optimises; the greedy answer is already the policy's mode and moves
    # by about the 64-prompt noise in 80 steps (-0.007 to +0.03 over seeds 1234, 1, 2, 3): it must not drop
    # by more than that noise (~2 standard errors of a 64-prompt mean difference).
    assert after > before - 0.025, (before, after)
    assert os.path.exists(result.best_checkpoint_path)
    # the best checkpoint loads back and becomes the current model
    trainer.load_checkpoint(result.best_checkpoint_path)
    saved = trainer.save_checkpoint(str(out / "saved" / "grpo.nemo"))
    from nemo_aligner.utils.nemo_file import list_members

    assert any(m.endswith("model_config.yaml") for m in list_members(saved))


def test_dpo_trainer_and_registry(weak_sft):
    from nemo_aligner.api import create_trainer, get_algorithm, list_algorithms
    from nemo_aligner.trainers.dpo import DPOTrainer

    out, data, model = weak_sft
    assert {"dpo", "grpo", "sft"} <= set(list_algorithms())
    assert get_algorithm("DPO") is DPOTrainer
    with pytest.raises(ConfigError, match=r"unknown algorithm 'ppo2'; registered: \['dpo', 'grpo'"):
        get_algorithm("ppo2")
    trainer = create_trainer("dpo", model=model, batch_size=32, learning_rate=2e-4, beta=0.2,
                             max_sequence_length=64, output_dir=str(out / "dpo"))
    pairs = [json.loads(line) for line in open(data["dpo_train"])][:320]
    result = trainer.fit(dataset=pairs, max_steps=10)
    assert result.total_steps == 10 and result.metrics["final_val_loss"] < 0.69  # below log 2: learned something
    assert trainer.config["dpo"]["beta"] == 0.2
    # the API's schedule: the learning_rate given, from the first step to the last
    assert [r["train/lr"] for r in read_metrics(str(out / "dpo" / "fit_1")) if "train/lr" in r] == [2e-4] * 10


def test_errors_are_clear(weak_sft, tmp_path):
    from nemo_aligner import GRPOTrainer, SFTTrainer
    from nemo_aligner.environments import BuiltinTaskEnvironment

    out, data, model = weak_sft
    trainer = GRPOTrainer.from_pretrained(model, num_prompts_per_step=4, num_generations_per_prompt=2,
                                          output_dir=str(tmp_path / "g"))
    with pytest.raises(ConfigError, match="exactly one of reward_fn"):
        trainer.fit(dataset=["reverse ab = "], reward_fn=lambda p, r: 0.0, environment=BuiltinTaskEnvironment())
    with pytest.raises(ConfigError, match="exactly one of reward_fn"):
        trainer.fit(dataset=["reverse ab = "])
    with pytest.raises(ConfigError, match="not a local file or directory; datasets are not downloaded"):
        trainer.fit(dataset="openai/gsm8k", reward_fn=lambda p, r: 0.0)
    with pytest.raises(ConfigError, match=r"policy\.model_name \(model_name_or_path\)='meta-llama/Llama-3-8B' does "
                                          r"not exist: give a local \.nemo file or Hugging Face model directory"):
        GRPOTrainer.from_pretrained("meta-llama/Llama-3-8B")  # at once, not at fit
    with pytest.raises(ConfigError, match=r"unknown argument\(s\) \['batch_sise'\]"):
        SFTTrainer.from_pretrained(model, batch_sise=3)
    with pytest.raises(AlignerError, match=r"dataset\[1\]: needs a prompt field"):
        trainer.fit(dataset=["ok", {"question_text": "x"}], reward_fn=lambda p, r: 0.0)


def test_grpo_saves_checkpoints_during_a_run_without_validation(weak_sft, tmp_path):
    """NeMo-RL's save_period: a GRPO run that never validates (val_period 0, the default) still
    leaves a checkpoint every save_period steps, so a run that fails midway keeps its progress."""
    from nemo_aligner import GRPOTrainer
    from nemo_aligner.trainers.callbacks import Callback
    from nemo_aligner.utils.checkpoint_callback import list_checkpoints

    out, data, model = weak_sft

    class FailAtStep3(Callback):
        def on_step_end(self, trainer, step, metrics):
            if step == 3:
                raise RuntimeError("hook failed at step 3")

    trainer = GRPOTrainer.from_pretrained(model, num_prompts_per_step=4, num_generations_per_prompt=2,
                                          max_sequence_length=64, max_new_tokens=6, save_period=2,
                                          output_dir=str(tmp_path / "g"))
    with pytest.raises(RuntimeError, match="hook failed at step 3"):
        trainer.fit(dataset=data["prompts_val"], reward_fn=lambda p, r: float(len(r) % 2), max_steps=5,
                    callbacks=[FailAtStep3()])
    saved = list_checkpoints(str(tmp_path / "g" / "fit_1" / "checkpoints"))
    assert [state["step"] for _, state in saved] == [2]
    trainer.load_checkpoint(saved[0][0])  # the step-2 policy becomes the current model
    with pytest.raises(ConfigError, match=r"grpo\.save_period=-1 must be >= 0"):
        GRPOTrainer.from_pretrained(model, save_period=-1)


def test_api_data_errors_name_the_users_record(tmp_path):
    """Records are checked as the user gave them: errors name dataset[i] (or the user's file:line)
    and the user's field, not the jsonl copy fit writes nor its renamed fields; TRL's conversational
    preference pairs are accepted."""
    from nemo_aligner.trainers.datasets import preference_records, prompt_records, resolve_dataset, sft_records
    from nemo_aligner.utils.errors import DataError

    with pytest.raises(DataError, match=r"^dataset\[1\]: field 'completion' must be a string, got int"):
        sft_records([{"prompt": "a", "completion": "b"}, {"prompt": "a", "completion": 5}])
    with pytest.raises(DataError, match=r"^dataset\[0\]: field 'output' is empty"):
        sft_records([{"input": "a", "output": ""}])
    path = tmp_path / "mine.jsonl"
    path.write_text('{"prompt": "a", "completion": "b"}\n{"prompt": ["x"], "completion": "b"}\n')
    with pytest.raises(DataError, match=rf"^{path}:2: field 'prompt' must be a string, got list"):
        sft_records(resolve_dataset(str(path))[0])
    with pytest.raises(DataError, match=r"^val_dataset\[0\]: the prompt \('question'\) must be a non-empty string"):
        prompt_records([{"question": 3}], "val_dataset")
    with pytest.raises(DataError, match=r"^dataset\[0\]: prompt\[0\]\.content must be str, got int"):
        preference_records([{"prompt": [{"role": "user", "content": 7}], "chosen": "a", "rejected": "b"}])
    with pytest.raises(DataError, match=r"^dataset\[0\]: field 'rejected' as a list must hold one assistant message"):
        preference_records([{"prompt": "q", "chosen": "a", "rejected": [{"role": "user", "content": "b"}]}])
    trl = [{"prompt": [{"role": "user", "content": "q"}], "chosen": [{"role": "assistant", "content": "good"}],
            "rejected": [{"role": "assistant", "content": "bad"}]}]
    assert preference_records(trl) == [{"prompt": [{"role": "user", "content": "q"}], "chosen_response": "good",
                                        "rejected_response": "bad"}]
    assert sft_records(resolve_dataset(str(path))[0][:1]) == ([{"input": "a", "output": "b"}], False)


def test_reward_functions_and_environments_get_the_prompt_records_other_fields(weak_sft, tmp_path):
    """A prompt record's other fields (a reference answer here) reach the reward function as the
    keyword arguments its signature names (TRL passes dataset columns so) and an environment as
    step(conversations, metadata) (NeMo-RL's form); a field the function needs and a record lacks is
    an error naming it."""
    from nemo_aligner import GRPOTrainer
    from nemo_aligner.environments import EnvironmentInterface, EnvironmentReturn
    from nemo_aligner.utils.errors import ConfigError

    out, data, model = weak_sft
    words = ["abc", "dog", "tree", "sun"]
    records = [{"prompt": f"reverse {w} =", "answer": w[::-1], "task_id": i} for i, w in enumerate(words)]
    seen = []

    def reward(prompt, response, answer):
        seen.append((prompt, answer))
        return float(response.strip().startswith(answer))

    trainer = GRPOTrainer.from_pretrained(model, num_prompts_per_step=4, num_generations_per_prompt=2,
                                          max_sequence_length=64, max_new_tokens=6, output_dir=str(tmp_path / "g"))
    trainer.fit(dataset=records, reward_fn=reward, max_steps=1)
    assert seen and all(prompt.endswith(f"reverse {answer[::-1]} =") for prompt, answer in seen)

    class Checker(EnvironmentInterface):
        calls = []

        def step(self, conversations, metadata=None):
            self.calls.append(metadata)
            return EnvironmentReturn(rewards=[float(c[-1]["content"].strip().startswith(m["answer"]))
                                              for c, m in zip(conversations, metadata)],
                                     done=[True] * len(conversations), observations=[None] * len(conversations))

    env = Checker()
    trainer.fit(dataset=records, environment=env, max_steps=1)
    rows = [m for call in env.calls for m in call]
    assert rows and all(set(m) == {"answer", "task_id"} for m in rows)
    assert sorted({m["task_id"] for m in rows}) == [0, 1, 2, 3]
    with pytest.raises(ConfigError, match=r"reward_fn takes \['answer'\], which the prompt .* has no field for "
                                          r"\(its other fields: \['task_id'\]\)"):
        trainer.fit(dataset=[{"prompt": r["prompt"], "task_id": 0} for r in records], reward_fn=reward, max_steps=1)


def test_direct_config_environment_and_nemo_rl_alias(weak_sft, tmp_path):
    import subprocess
    import sys

    out, data, model = weak_sft
    script = f"""
from nemo_rl import GRPOTrainer
from nemo_rl.api import list_algorithms, create_trainer
from nemo_rl.trainers.callbacks import Callback
from nemo_aligner.environments import BuiltinTaskEnvironment, EnvironmentReturn
class AskTwice(BuiltinTaskEnvironment):  # the first answer earns nothing; the task asks again and scores the second
    def step(self, conversations, metadata=None):
        first = [sum(m["role"] == "assistant" for m in c) == 1 for c in conversations]
        scored = super().step(conversations, metadata)
        return EnvironmentReturn([0.0 if f else r for f, r in zip(first, scored.rewards)], [not f for f in first],
                                 [{{"role": "user", "content": " again: " + c[0]["content"]}} if f else None
                                  for f, c in zip(first, conversations)])
trainer = GRPOTrainer({{"policy": {{"model_name": {model!r}, "learning_rate": 1e-5, "max_total_sequence_length": 64,
                                   "dtensor_cfg": {{"tensor_parallel_size": 1}}}},
                       "grpo": {{"num_prompts_per_step": 4, "num_generations_per_prompt": 2, "max_new_tokens": 8}},
                       "output_dir": {str(tmp_path / "alias")!r}}})
class C(Callback):
    def on_step_end(self, trainer, step, metrics):
        print("STEP", step, round(metrics["rewards"], 4), "TURNS", metrics["turns"])
result = trainer.fit(dataset={data["prompts_val"]!r}, environment=AskTwice(), max_steps=2, callbacks=[C()])
print("ALGOS", list_algorithms(), "STEPS", result.total_steps)
"""
    proc = subprocess.run([sys.executable, "-c", script], env=subprocess_env(), cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "STEP 1" in proc.stdout and "STEP 2" in proc.stdout
    # a two-turn environment plays both turns (max_rollout_turns defaults to 8 with an environment)
    turns = [float(t) for t in re.findall(r"TURNS ([0-9.]+)", proc.stdout)]
    assert turns and all(1.0 < t <= 2.0 for t in turns), proc.stdout[-2000:]
    from nemo_aligner.api import list_algorithms

    assert f"ALGOS {list_algorithms()} STEPS 2" in proc.stdout  # the alias sees the same registry


def test_from_pretrained_imports_a_hugging_face_directory(tmp_path, mcore_single):
    """A local HF directory is converted once into the trainer's output dir and used as its model."""
    from test_hf_interop import tiny_hf

    from nemo_aligner import SFTTrainer
    from nemo_aligner.utils.nemo_file import read_model_config

    tiny_hf("llama").save_pretrained(tmp_path / "hf_llama")
    trainer = SFTTrainer.from_pretrained(str(tmp_path / "hf_llama"), output_dir=str(tmp_path / "out"))
    path = trainer.model_path
    assert os.path.dirname(path) == str(tmp_path / "out" / "imported") and os.path.isfile(path)
    assert os.path.basename(path).startswith("hf_llama-") and path.endswith(".nemo")
    cfg = read_model_config(path)
    assert cfg.normalization == "rmsnorm" and cfg.num_query_groups == 2 and cfg.rotary_base == 5000
    assert SFTTrainer.from_pretrained(str(tmp_path / "hf_llama"), output_dir=str(tmp_path / "out")).model_path == path
    # another model in a directory of the same name, same output_dir: imported anew, not the cached Llama
    tiny_hf("gpt2", True).save_pretrained(tmp_path / "other" / "hf_llama")
    other = SFTTrainer.from_pretrained(str(tmp_path / "other" / "hf_llama"), output_dir=str(tmp_path / "out"))
    assert other.model_path != path and read_model_config(other.model_path).normalization == "layernorm"
    # the default learning_rate (2e-5), constant past the scripts' warm-up and under their min_lr
    result = trainer.fit(dataset=[{"input": "reverse ab =", "output": "ba"}] * 64, max_steps=12)
    assert result.total_steps == 12 and os.path.isfile(result.model_path)
    assert [r["train/lr"] for r in read_metrics(str(tmp_path / "out" / "fit_1")) if "train/lr" in r] == [2e-5] * 12


def test_api_arguments_are_checked_before_anything_runs(weak_sft, tmp_path):
    """Mistakes a TRL user makes name the argument or key at once; nothing is written meanwhile."""
    from nemo_aligner import DPOTrainer, GRPOTrainer, SFTTrainer
    from nemo_aligner.api import get_algorithm, register_algorithm
    from nemo_aligner.trainers.callbacks import Callback
    from nemo_aligner.utils.errors import CheckpointError

    _, data, model = weak_sft
    out = tmp_path / "g"
    base = {"policy": {"model_name": model}, "output_dir": str(out)}
    config_cases = [
        ({"policy": {"model_name": model, "learning_rat": 1e-6}}, r"unknown key\(s\) \['policy\.learning_rat'\]"),
        (dict(base, grpo={"num_generations_per_promt": 4}), r"unknown key\(s\) \['grpo\.num_generations_per_promt'\]"),
        (dict(base, output_directory="x"), r"unknown config key\(s\) \['output_directory'\]"),
        ({"policy": {"model_name": model, "learning_rate": None}}, r"policy\.learning_rate=None must be a number"),
        ({"policy": {"model_name": model, "learning_rate": "2e-5x"}}, r"policy\.learning_rate='2e-5x' must be a number"),
        (dict(base, grpo={"num_prompts_per_step": -2}), r"grpo\.num_prompts_per_step=-2 must be >= 1"),
        (dict(base, overrides=["model.optim.lr=1"]), r"overrides must be a dict of dotted config keys"),
    ]
    for config, pattern in config_cases:
        with pytest.raises(ConfigError, match=pattern):
            GRPOTrainer(config)
    with pytest.raises(ConfigError, match=r"dpo\.beta=-1 must be > 0"):
        DPOTrainer.from_pretrained(model, beta=-1)
    (tmp_path / "a_file").write_text("x")
    with pytest.raises(ConfigError, match=r"output_dir=.*a_file' is a file, not a directory"):
        SFTTrainer.from_pretrained(model, output_dir=str(tmp_path / "a_file"))

    trainer = GRPOTrainer.from_pretrained(model, num_prompts_per_step=4, num_generations_per_prompt=2,
                                          output_dir=str(out))
    reward = lambda prompt, response: 0.0  # noqa: E731
    fit_cases = [
        (dict(reward_fn=reward, num_train_epochs=1), ConfigError, r"unknown argument\(s\) \['num_train_epochs'\]"),
        (dict(reward_fn=reward, max_steps="two"), ConfigError, r"GRPOTrainer\.fit\(max_steps\)='two' must be an integer"),
        (dict(reward_fn=reward, max_steps=-3), ConfigError, r"GRPOTrainer\.fit\(max_steps\)=-3 must be >= 1"),
        (dict(reward_fn=lambda completions, **kw: [0.0]), ConfigError,
         r"cannot be called as reward_fn\(prompt, response, \*\*fields\) -> float"),
        (dict(reward_fn=5), ConfigError, r"reward_fn must be a function \(prompt, response\) -> float, got int"),
        (dict(environment=lambda conversations: None), ConfigError, r"environment must have a step\(conversations\)"),
    ]

    class TrlStyle:
        def on_step_end(self, args, state, control, **kwargs):
            pass

    class Fine(Callback):
        pass

    fit_cases += [
        (dict(reward_fn=reward, callbacks=Fine()), TypeError, r"callbacks must be a list of callbacks"),
        (dict(reward_fn=reward, callbacks=[Fine]), TypeError, r"callback Fine is a class; pass an instance"),
        (dict(reward_fn=reward, callbacks=[TrlStyle()]), TypeError,
         r"TrlStyle\.on_step_end\(args, state, control, \*\*kwargs\) cannot be called as on_step_end\(trainer, step, "
         r"metrics\)"),
    ]
    for kwargs, error, pattern in fit_cases:
        with pytest.raises(error, match=pattern):
            trainer.fit(dataset=["reverse ab = "], **kwargs)
    assert not out.exists()  # every mistake was caught before a run directory was made

    (tmp_path / "ckpt_dir").mkdir()
    with pytest.raises(ConfigError, match=r"save_checkpoint\(.*ckpt_dir'\): is a directory"):
        trainer.save_checkpoint(str(tmp_path / "ckpt_dir"))
    assert os.listdir(tmp_path / "ckpt_dir") == [] and not any(".tmp." in p for p in os.listdir(tmp_path))
    with pytest.raises(CheckpointError, match=r"load_checkpoint\(path\)"):
        trainer.load_checkpoint(data["prompts_val"])

    from nemo_aligner import api

    with pytest.raises(ConfigError, match=r"algorithm 'sft' is already registered"):
        register_algorithm("sft", "my_package:MyTrainer")
    try:
        register_algorithm("broken_algo", "no_such_package_x.trainers:T")
        with pytest.raises(ConfigError, match=r"algorithm 'broken_algo': cannot import 'no_such_package_x\.trainers'"):
            get_algorithm("broken_algo")
        register_algorithm("not_a_trainer", "json:dumps")
        with pytest.raises(ConfigError, match=r"is not a trainer class \(it has no from_pretrained\)"):
            get_algorithm("not_a_trainer")
    finally:
        api._REGISTRY.pop("broken_algo", None)
        api._REGISTRY.pop("not_a_trainer", None)
