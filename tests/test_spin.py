"""SPIN: the data split and pairs by hand, the per-iteration beta and its checks, the reference
policy moving at iteration ends and surviving a resume (TP=2), the Python API, and self-play on the
built-in task raising the held-out likelihood of the data's answers for 3 seeds."""

import json
import re

import numpy as np
import pytest
import torch

from conftest import read_metrics, run_script
from nemo_aligner.data.nlp.sft_dataset import GPTSFTChatDataset, GPTSFTDataset
from nemo_aligner.data.nlp.spin_dataset import collate_spin, prompt_and_answer, spin_pairs
from nemo_aligner.utils.errors import ConfigError
from nemo_aligner.utils.tokenizers import ByteTokenizer

TOK = ByteTokenizer()


def ids(text):
    return list(text.encode())


def test_prompt_and_answer_of_prompt_answer_and_chat_records():
    ds = GPTSFTDataset(None, TOK, 64, records=[{"input": "sort cba =", "output": "abc", "__line__": 1}])
    prompt, answer = prompt_and_answer(ds[0])
    assert prompt == ids("sort cba = ") and answer == ids("abc") + [TOK.eos_id]
    chat = GPTSFTChatDataset(None, TOK, 256, records=[{"system": "S", "mask": "User", "__line__": 1, "conversations": [
        {"from": "User", "value": "Hi"}, {"from": "Assistant", "value": "Hello"},
        {"from": "User", "value": "Q2"}, {"from": "Assistant", "value": "A2"}]}])
    prompt, answer = prompt_and_answer(chat[0])
    # the last trained turn is the answer; everything before it, earlier answers included, the prompt
    assert bytes(answer).decode() == "A2\n\x11"
    assert bytes(prompt).decode() == "\x00System\nS\n\x11User\nHi\n\x11Assistant\nHello\n\x11User\nQ2\n\x11Assistant\n"


def test_a_record_of_the_other_sft_format_names_the_chat_key(tmp_path):
    """A chat record read as prompt/answer (and the reverse) is refused naming the file:line and the
    ``model.data.chat`` value that reads it (SPIN's default is chat, SFT's prompt/answer);
    ``compute_topk_logits.py``'s section is ``data.data``, its key ``data.chat``."""
    from omegaconf import OmegaConf

    from nemo_aligner.data.nlp.builders import build_sft_dataset
    from nemo_aligner.utils.errors import DataError

    chat = {"__line__": 3, "conversations": [{"from": "User", "value": "q"}, {"from": "Assistant", "value": "a"}]}
    with pytest.raises(DataError, match=r"d\.jsonl:3: missing field 'input' .*a chat record; set model\.data\.chat=True"):
        GPTSFTDataset("d.jsonl", TOK, 64, records=[chat])
    with pytest.raises(DataError, match=r"d\.jsonl:5: missing field 'conversations' .*a prompt/answer record; "
                                        r"set model\.data\.chat=False"):
        GPTSFTChatDataset("d.jsonl", TOK, 64, records=[{"__line__": 5, "input": "q", "output": "a"}])
    with pytest.raises(DataError, match=r"d\.jsonl:7: missing field 'output' \(found \['input'\]\)$"):
        GPTSFTDataset("d.jsonl", TOK, 64, records=[{"__line__": 7, "input": "q"}])  # no hint: not a chat record
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"input": "q", "output": "a"}) + "\n")
    with pytest.raises(DataError, match=r"p\.jsonl:1: missing field 'conversations' .*set data\.chat=False to read them$"):
        build_sft_dataset(OmegaConf.create({"file_path": str(path)}), TOK, 64, True, True, key="data.data")


def test_pairs_put_the_data_answer_against_the_generation():
    batch = collate_spin([{"input_ids": ids("ab=") + ids("cd") + [TOK.eos_id], "answer_start": 3}],
                         TOK.eos_id, 32)
    assert batch["prompts"] == [ids("ab=")] and batch["answers"] == [ids("cd") + [TOK.eos_id]]
    assert batch["loss_mask"][0].tolist()[:6] == [0, 0, 1, 1, 1, 0]  # the validation loss: answer + EOS
    pairs = spin_pairs(batch["prompts"], batch["answers"], [ids("x")], TOK.eos_id, 32, pad_to_multiple_of=1)
    assert pairs["chosen"][0].tolist() == ids("ab=cd") + [TOK.eos_id]
    assert pairs["rejected"][0].tolist() == ids("ab=x") + [TOK.eos_id, TOK.eos_id]  # padded with EOS
    # log-prob position i predicts token i + 1: the responses' tokens only
    assert pairs["chosen_mask"][0].tolist() == [0, 0, 1, 1, 1]
    assert pairs["rejected_mask"][0].tolist() == [0, 0, 1, 0, 0]


def test_answer_agreement_by_hand():
    from nemo_aligner.algorithms.spin import answer_agreement

    got = answer_agreement([[1, 2, 3], [4, 5], [7]], [[1, 2, 3], [4, 6, 0], [8, 7]])
    assert got["generated_answer_match"] == pytest.approx(1 / 3)
    assert got["generated_token_agreement"] == pytest.approx((3 + 1 + 0) / 8)


def test_beta_per_iteration_and_bad_values():
    from nemo_aligner.models.nlp.gpt.megatron_gpt_spin_model import kl_penalty_schedule

    assert kl_penalty_schedule({"ref_policy_kl_penalty": 0.2}) == [0.2]
    assert kl_penalty_schedule({"ref_policy_kl_penalty": [0.1, 0.2, 0.4]}) == [0.1, 0.2, 0.4]
    for bad, message in ((0.0, "each beta must be > 0"), ([0.1, -1], "each beta must be > 0"),
                         ("x", "must be a number or a list"), ([], "needs one value")):
        with pytest.raises(ConfigError, match=re.escape(message)):
            kl_penalty_schedule({"ref_policy_kl_penalty": bad})


def test_iterations_switch_beta_and_move_the_reference(mcore_single, tmp_path, monkeypatch):
    """Over 2 iterations of 2 steps: the beta of each iteration is used, the reference is the
    starting weights until the end of iteration 0 and the weights after step 2 from then on, and
    the model's generations come from the reference, not the policy being trained."""
    from omegaconf import OmegaConf

    from conftest import TINY_ARCH
    from nemo_aligner.algorithms.spin import SPINTrainer
    from nemo_aligner.data.nlp.builders import build_dataloader
    from nemo_aligner.models.nlp.gpt.megatron_gpt_spin_model import MegatronGPTSPINModel
    from nemo_aligner.utils.loggers import MetricLogger

    torch.manual_seed(0)
    cfg = OmegaConf.create(dict(TINY_ARCH, micro_batch_size=2, global_batch_size=4, encoder_seq_length=32,
                                spin={"ref_policy_kl_penalty": [0.3, 0.7], "rollout_micro_batch_size": 4,
                                      "length_params": {"max_length": 4}},
                                optim={"name": "fused_adam", "lr": 1e-2, "sched": {"name": "Constant"}}))
    model = MegatronGPTSPINModel(cfg, TOK)
    with pytest.raises(ConfigError, match="has 2 values for trainer.spin.max_iterations=3"):
        model.check_iterations(3)
    model.snapshot_reference_policy()
    start = {k: v.clone() for k, v in model.ref_state.items()}
    records = [{"input": f"sort {w} =", "output": "".join(sorted(w)), "__line__": i}
               for i, w in enumerate(["cab", "bca", "dac", "cbd", "bad", "dab", "acd", "dcb"])]
    ds = GPTSFTDataset(None, TOK, 32, records=records)
    dl = build_dataloader(ds, OmegaConf.create({"global_batch_size": 4, "micro_batch_size": 2, "shuffle": True,
                                                "drop_last": True}),
                          lambda s: collate_spin(s, TOK.eos_id, 32), 0, 1, 1, train=True, key="model")
    trainer_cfg = OmegaConf.create({"max_iterations": 2, "max_epochs": 1, "max_steps": -1, "val_check_interval": 0,
                                    "save_interval": 0})
    optimizer, scheduler = model.setup_optimization(4)
    trainer = SPINTrainer(trainer_cfg, model, optimizer, scheduler, dl, None,
                          MetricLogger(str(tmp_path), create_tensorboard=False), None)
    assert trainer.max_steps == 4 and trainer.steps_per_iteration == 2
    betas, refs, generated_by_reference = [], [], []
    import nemo_aligner.models.nlp.gpt.megatron_gpt_spin_model as spin_module

    real_generate = spin_module.generate

    def spy(module, *args, **kwargs):  # the weights in the module while generating: the reference's
        weights = module.state_dict()
        generated_by_reference.append(all(torch.equal(model.ref_state[k], weights[k].cpu()) for k in model.ref_state))
        return real_generate(module, *args, **kwargs)

    monkeypatch.setattr(spin_module, "generate", spy)
    for _ in range(4):
        batch = next(iter(dl))
        trainer.train_single_step(batch)
        trainer.step += 1
        betas.append(model.beta)
        refs.append({k: v.clone() for k, v in model.ref_state.items()})
    after_step2 = refs[1]
    assert betas == [0.3, 0.3, 0.7, 0.7] and generated_by_reference == [True] * 4
    assert all(torch.equal(refs[0][k], start[k]) for k in start)  # iteration 0: the starting weights
    now = model.module.state_dict()
    assert not all(torch.equal(after_step2[k], start[k]) for k in start)  # moved at the end of iteration 0
    assert all(torch.equal(refs[2][k], after_step2[k]) for k in start)  # and held through iteration 1
    assert all(torch.equal(refs[3][k], now[k].cpu()) for k in start)  # the end of iteration 1: the final weights


def test_unusable_settings_are_one_line(tmp_path, weak_policy):
    """A beta list shorter than the iterations and a zero rollout micro-batch size: exit 1, one ``error:`` line."""
    model, data = weak_policy
    common = [f"pretrained_checkpoint.restore_from_path={model}", f"model.data.train_ds.file_path={data['sft_train']}",
              f"model.data.validation_ds.file_path={data['sft_val']}", f"exp_manager.explicit_log_dir={tmp_path / 'x'}",
              "model.data.chat=False"]
    for extra, message in ((["trainer.spin.max_iterations=3", "model.spin.ref_policy_kl_penalty=[0.1,0.2]"],
                            "error: model.spin.ref_policy_kl_penalty has 2 values for trainer.spin.max_iterations=3"),
                           (["model.spin.rollout_micro_batch_size=0"],
                            "error: model.spin.rollout_micro_batch_size=0 must be > 0")):
        proc = run_script("train_gpt_spin.py", common + extra, check=False)
        assert proc.returncode == 1 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]


def _spin(model, data, log_dir, seed, extra=(), **kwargs):
    return run_script("train_gpt_spin.py", [
        f"pretrained_checkpoint.restore_from_path={model}", f"model.data.train_ds.file_path={data['sft_train']}",
        f"model.data.validation_ds.file_path={data['sft_val']}", f"exp_manager.explicit_log_dir={log_dir}",
        "model.data.chat=False", "model.global_batch_size=64", "model.micro_batch_size=16", "model.spin.rollout_micro_batch_size=64",
        "model.spin.length_params.max_length=9", "model.optim.lr=2e-5", "model.optim.sched.name=Constant",
        "model.spin.ref_policy_kl_penalty=0.1", f"model.seed={seed}", *extra], **kwargs)


def greedy_task_score(nemo: str, prompts_file: str) -> float:
    """Mean built-in task score of greedy responses (9 new tokens at most) to the held-out prompts."""
    from nemo_aligner.data.nlp.builtin_task import BuiltinTask
    from nemo_aligner.recipes.evaluate import greedy_score

    return greedy_score(str(nemo), [json.loads(line)["text"] for line in open(prompts_file)], BuiltinTask.score)


@pytest.mark.learning
@pytest.mark.parametrize("seed", [1234, 7, 11])
def test_self_play_raises_held_out_likelihood_of_the_answers(tmp_path, weak_policy, seed, mcore_single):
    """From a partly trained SFT model, 3 iterations of 15 steps (64 prompts each): the held-out SFT
    loss (the negative log-likelihood of the data's answers) ends below the starting model's, the
    policy prefers the data's answers to its reference's generations (a positive implicit-reward
    margin in every iteration), and each iteration's reference generates closer to the answers than the starting model."""
    model, data = weak_policy
    log_dir = tmp_path / "spin"
    proc = _spin(model, data, log_dir, seed, ["trainer.spin.max_iterations=3", "trainer.spin.limit_train_batches=15",
                                             "trainer.spin.val_check_interval=15", "trainer.spin.val_at_start=True",
                                             "trainer.spin.save_interval=0", "exp_manager.checkpoint_callback_params.save_top_k=1"])
    metrics = read_metrics(log_dir)
    val = {r["step"]: r["val/loss"] for r in metrics if "val/loss" in r}
    train = [r for r in metrics if "train/generated_token_agreement" in r]
    assert sorted(val) == [0, 15, 30, 45] and len(train) == 45
    agreement = [np.mean([r["train/generated_token_agreement"] for r in train[i * 15:(i + 1) * 15]]) for i in range(3)]
    margin = [np.mean([r["train/reward_margin"] for r in train[i * 15:(i + 1) * 15]]) for i in range(3)]
    before, after = (greedy_task_score(m, data["prompts_val"]) for m in (model, log_dir / "checkpoints" / "megatron_gpt.nemo"))
    print(f"SPIN seed {seed}: held-out SFT loss {val}; generation/answer agreement per iteration {agreement}; "
          f"train reward margin {margin}; greedy held-out score {before:.3f} -> {after:.3f}")
    assert val[45] < val[0] - 0.01, val
    assert all(m > 0 for m in margin), margin
    assert after > before, (before, after)
    assert "SPIN finished: 45 steps in 3 iterations" in proc.stdout


def test_nemo_aligners_spin_command_reads_chat_records(tmp_path, weak_policy):
    """NeMo-Aligner's SPIN tutorial command sets no data format: its default reads NeMo chat records
    with NeMo-Aligner's ``<extra_id_*>`` turn strings (sizes changed for the tiny model), also with its
    gpt_spin.yaml's ``prompt_template: null``; prompt/answer records under that default are refused in one
    line naming the key that reads them."""
    model, data = weak_policy
    command = ["trainer.num_nodes=1", "trainer.devices=1", "model.micro_batch_size=2", "model.global_batch_size=8",
               f"pretrained_checkpoint.restore_from_path={model}", "exp_manager.create_wandb_logger=false",
               f"exp_manager.explicit_log_dir={tmp_path / 'spin'}", "trainer.spin.max_iterations=1",
               "trainer.spin.max_epochs=1", "trainer.spin.max_steps=2", "trainer.spin.val_check_interval=2",
               "trainer.spin.limit_val_batches=1", "model.spin.length_params.max_length=9"]
    proc = run_script("train_gpt_spin.py", command + [f"model.data.train_ds.file_path={data['chat_train']}",
                                                      f"model.data.validation_ds.file_path={data['chat_val']}",
                                                      "model.data.train_ds.prompt_template=null"])
    train = [r for r in read_metrics(tmp_path / "spin") if "train/loss" in r]
    assert [r["step"] for r in train] == [1, 2] and all(np.isfinite(r["train/loss"]) for r in train)
    assert "SPIN finished: 2 steps in 1 iteration," in proc.stdout  # an iteration that max_steps cut short
    wrong = run_script("train_gpt_spin.py", command + [f"model.data.train_ds.file_path={data['sft_train']}",
                                                       f"model.data.validation_ds.file_path={data['sft_val']}"],
                       check=False)
    errors = [line for line in wrong.stderr.splitlines() if line.startswith("error:")]
    assert wrong.returncode == 1 and "Traceback" not in wrong.stderr, wrong.stderr[-2000:]
    assert len(errors) == 1 and f"{data['sft_train']}:1: missing field 'conversations'" in errors[0], errors
    assert errors[0].endswith("a prompt/answer record; set model.data.chat=False to read them"), errors


def test_resume_keeps_the_moved_reference_even_at_another_tp(tmp_path, weak_policy):
    """2 iterations of 2 steps: 3 steps, a stop, and a 4th resumed at tensor parallel 2 (the script
    starts both ranks; the checkpoint is resharded) equal 4 steps in one go at pipeline parallel 2;
    the 4th step's reference (the weights after step 2) comes from the checkpoint."""
    model, data = weak_policy
    extra = ["trainer.spin.max_iterations=2", "trainer.spin.limit_train_batches=2", "trainer.spin.val_check_interval=0",
             "trainer.spin.save_interval=1", "model.global_batch_size=8", "model.micro_batch_size=4",
             "model.spin.rollout_micro_batch_size=8", "model.optim.lr=1e-3"]
    _spin(model, data, tmp_path / "straight", 1234, extra + ["trainer.devices=2", "model.pipeline_model_parallel_size=2"],
          like_nproc=2)
    _spin(model, data, tmp_path / "resumed", 1234, extra + ["trainer.spin.max_steps=3"])
    proc = _spin(model, data, tmp_path / "resumed", 1234,
                 extra + ["trainer.devices=2", "model.tensor_model_parallel_size=2"], like_nproc=2)
    assert "SPIN resumed in iteration 1 of 2" in proc.stdout + proc.stderr

    def step4(log_dir):
        return [r for r in read_metrics(log_dir) if r.get("step") == 4 and "train/loss" in r][-1]

    a, b = step4(tmp_path / "straight"), step4(tmp_path / "resumed")
    assert b["train/generated_token_agreement"] == a["train/generated_token_agreement"]  # the same generations
    for key in ("train/loss", "train/rewards_chosen_mean", "train/rewards_rejected_mean"):
        assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key


def test_python_api_runs_spin(tmp_path, weak_policy):
    """``create_trainer("spin", ...)``: the same job from Python on prompt/answer records, a beta per
    iteration; bad settings are refused before anything runs."""
    from nemo_aligner.api import create_trainer, list_algorithms
    from nemo_aligner.trainers.callbacks import Callback

    model, data = weak_policy
    assert "spin" in list_algorithms()
    seen = []

    class Record(Callback):
        def on_step_end(self, trainer, step, metrics):
            seen.append((step, metrics["beta"]))

    records = [json.loads(line) for line in open(data["sft_train"])][:16]  # 2 steps per iteration
    trainer = create_trainer("spin", model=model, batch_size=8, learning_rate=1e-5, beta=[0.1, 0.3], iterations=2,
                             max_new_tokens=9, max_sequence_length=32, output_dir=str(tmp_path / "api"))
    result = trainer.fit(dataset=records, max_steps=3, callbacks=[Record()])
    assert result.total_steps == 3 and seen == [(1, 0.1), (2, 0.1), (3, 0.3)]
    assert trainer.model_path.endswith(".nemo") and trainer.model_path != model
    with pytest.raises(ConfigError, match=r"spin.beta=0 must be > 0"):
        create_trainer("spin", model=model, beta=[0.1, 0])
    with pytest.raises(Exception, match="prompt/answer records"):
        create_trainer("spin", model=model).fit(dataset=["just a text"])
