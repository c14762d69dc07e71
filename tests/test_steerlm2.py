"""SteerLM 2.0: importance weights and baselines by hand, the weighted loss against one computed from
the model's own logits, the record format and its errors, and an iteration on the built-in task
(SteerLM model, SFT model and regression reward model) that brings generations closer to the
asked attribute values."""

import json
import math

import numpy as np
import pytest
import torch

from conftest import read_metrics, run_python, run_script, SCRIPTS
from nemo_aligner.data.nlp.steerlm2_dataset import SteerLM2Dataset, collate_steerlm2, importance_weights
from nemo_aligner.utils.errors import DataError
from nemo_aligner.utils.tokenizers import ByteTokenizer

TOK = ByteTokenizer()


def record(values=("abc", "cab"), logs=((-1.0, -2.0, -3.0), (-4.0, -1.5, -2.5)), label="quality:4", line=1):
    return {"system": "", "prompt_turns": [{"from": "User", "value": "sort cab ="}], "label": label, "__line__": line,
            "responses": [{"from": "Assistant", "value": v, "log(P(a|x,y))": a, "log(P(y|x))": p, "log(Q(y|a,x))": q}
                          for v, (a, p, q) in zip(values, logs)]}


def test_importance_weights_and_baseline_by_hand():
    from nemo_aligner.models.nlp.gpt.gpt_steerlm2_model import steerlm2_weights

    ws = importance_weights([-1.0, -4.0], [-2.0, -1.5], [-3.0, -2.5])
    logw = [-1 - 2 + 3, -4 - 1.5 + 2.5]  # log P(a|x,y) + log P(y|x) - log Q(y|a,x)
    assert ws == pytest.approx([math.exp(w) / sum(math.exp(x) for x in logw) for w in logw])
    nll, log_q = torch.tensor([2.0, 3.5]), torch.tensor([-3.0, -2.5])  # log Q_theta = -nll
    weight, base, distance = steerlm2_weights(torch.tensor(ws), nll, log_q, 2)
    b = [math.exp(-2 + 3), math.exp(-3.5 + 2.5)]
    b = [x / sum(b) for x in b]
    assert base.tolist() == pytest.approx(b) and weight.tolist() == pytest.approx([ws[0] - b[0], ws[1] - b[1]])
    assert distance.item() == pytest.approx(sum(w * math.log(w / x) for w, x in zip(ws, b)), rel=1e-5)
    # the policy that reweights its samples as the target does gets no gradient
    same = torch.log(torch.tensor(ws, dtype=torch.float64)) + log_q.double()
    assert steerlm2_weights(torch.tensor(ws), -same, log_q, 2)[0].abs().max() < 1e-6


def test_records_render_as_steerlm_prompts_and_are_checked():
    cut = SteerLM2Dataset([record()], TOK, 40)[0]  # a prompt longer than the sequence: nothing left to train
    assert len(cut["input_ids"][0]) == 41 and len(cut["mask"][0]) == 41 and not any(cut["mask"][0])
    ds = SteerLM2Dataset([record()], TOK, 128)
    item = ds[0]
    prompt = "\x00System\n\n\x11User\nsort cab =\n\x11Assistant\n\x12quality:4\n"
    assert bytes(item["input_ids"][0]).decode() == prompt + "abc\n\x11"
    assert sum(item["mask"][1]) == len("cab\n\x11")
    batch = collate_steerlm2([item, ds[0]], TOK.eos_id)
    assert batch["tokens"].shape[0] == 4 and batch["group"].tolist() == [0, 0, 1, 1]
    assert batch["loss_mask"][0].sum() == len("abc\n\x11")
    bad = [({"prompt_turns": []}, "prompt_turns must be an odd-length list"),
           ({"responses": []}, "responses must be a non-empty list"),
           ({"responses": [{"from": "Assistant", "value": "x", "log(P(a|x,y))": float("nan"), "log(P(y|x))": 0,
                            "log(Q(y|a,x))": 0}]}, r"responses\[0\]\['log\(P\(a\|x,y\)\)'\] must be a finite number")]
    for change, message in bad:
        with pytest.raises(DataError, match=r"d\.jsonl:1: " + message):
            SteerLM2Dataset([dict(record(), **change, __file__="d.jsonl")], TOK, 128)
    with pytest.raises(DataError, match=r"d\.jsonl:2: 1 responses; the other records have 2"):
        SteerLM2Dataset([dict(record(), __file__="d.jsonl"),
                         dict(record(values=("a",), logs=((0, 0, 0),), line=2), __file__="d.jsonl")], TOK, 128)


def test_weighted_loss_from_the_models_own_logits(mcore_single):
    from omegaconf import OmegaConf

    from conftest import TINY_ARCH, forward_logits
    from nemo_aligner.models.nlp.gpt.gpt_steerlm2_model import GPTSteerLM2Model

    torch.manual_seed(2)
    cfg = OmegaConf.create(dict(TINY_ARCH, micro_batch_size=1, global_batch_size=2, encoder_seq_length=64,
                                steerlm2={"micro_batch_size": 2, "forward_micro_batch_size": 4}))
    model = GPTSteerLM2Model(cfg, TOK)
    ds = SteerLM2Dataset([record(), record(values=("acb", "b"), logs=((-0.5, -1.0, -2.0), (-2.0, -3.0, -1.0)))],
                         TOK, 64)
    batch = collate_steerlm2([ds[0], ds[1]], TOK.eos_id)
    loss, metrics = model.get_loss_and_metrics(batch, forward_only=True)
    logp = torch.log_softmax(forward_logits(model, batch["tokens"]).double(), -1)
    nll = -(logp.gather(-1, batch["labels"].unsqueeze(-1)).squeeze(-1) * batch["loss_mask"]).sum(-1)
    expected, distances = 0.0, []
    for g in range(2):
        rows = [2 * g, 2 * g + 1]
        ws = batch["ws"][rows].double()
        base = torch.softmax(-nll[rows] - batch["log_q"][rows].double(), 0)
        tokens = batch["loss_mask"][rows].sum(-1).mean()
        expected += float(((ws - base) * nll[rows]).sum() / tokens) / 2
        distances.append(float((ws * (ws / base).log()).sum()))
    assert loss == pytest.approx(expected, rel=1e-4, abs=1e-6)
    assert metrics["distance"] == pytest.approx(np.mean(distances), rel=1e-3)


GENERATOR = f"{SCRIPTS}/../data/steerlm/generate_steerlm2_data.py"


def _quality_scores(nemo, prompts, out):
    """Greedy task score of held-out prompts asking for quality 0, 2 and 4."""
    from nemo_aligner.data.nlp.builtin_task import BuiltinTask

    asked = out.parent / f"{out.stem}_prompts.jsonl"
    asked.write_text("".join(json.dumps({"prompt": p, "attributes": {"quality": q}}) + "\n"
                             for q in (0, 2, 4) for p in prompts))
    run_script("generate_gpt.py", [f"gpt_model_file={nemo}", f"prompts_file={asked}", f"output_file={out}",
                                   "inference.tokens_to_generate=12", "inference.end_strings=['\n']", "batch_size=64"])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    n = len(prompts)
    return {q: float(np.mean([BuiltinTask.score(BuiltinTask.prompt_text(r["prompt"]), r["response"])
                              for r in rows[i * n:(i + 1) * n]])) for i, q in enumerate((0, 2, 4))}


@pytest.fixture(scope="module")
def steerlm_scores(tmp_path_factory, steerlm_nemo):
    """The SteerLM model's greedy task scores by asked quality (before SteerLM 2.0)."""
    model, data = steerlm_nemo
    prompts = [json.loads(line)["input"] for line in open(data["sft_val"])]
    return _quality_scores(model, prompts, tmp_path_factory.mktemp("steerlm_scores") / "before.jsonl")


@pytest.mark.learning
@pytest.mark.parametrize("seed", [1234, 7, 11])
def test_an_iteration_steers_the_policy_by_the_asked_quality(tmp_path, steerlm_nemo, sft_nemo, regression_rm,
                                                              steerlm_scores, seed):
    """The SteerLM model samples 4 responses to 192 built-in prompts x {quality:4, 2, 0}; the SFT model
    gives log P(y|x), the regression reward model log P(a|x,y) (sigma 0.5: its quality error is about
    1, and sigma 1 barely tells the responses apart). One epoch of SteerLM 2.0 on them: greedy answers
    asked for quality 4 score further above those asked for quality 0 than the SteerLM model's do
    (the task score of a quality-q answer is about q/4), and the held-out KL between the target
    weights and the policy's own (``distance``) does not grow."""
    model, data = steerlm_nemo
    rm = f"{regression_rm}/checkpoints/megatron_gpt.nemo"
    inputs = {split: [json.loads(line)["input"] for line in open(data[f"sft_{split}"])] for split in ("train", "val")}
    files = {}
    for split, prompts in (("train", inputs["train"][:192]), ("val", inputs["val"][:32])):
        (tmp_path / f"{split}_prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
        files[split] = tmp_path / f"{split}.jsonl"
        run_python(GENERATOR, ["--input-file", str(tmp_path / f"{split}_prompts.jsonl"), "--output-file", str(files[split]),
                               "--labels", "quality:4;quality:2;quality:0", "--steerlm-model", model, "--sft-model", sft_nemo,
                               "--reward-model", rm, "--num-responses", "4", "--sft-format", "plain", "--rm-format",
                               "plain", "--max-new-tokens", "12", "--batch-size", "96", "--attribute-sigma", "0.5",
                               "--seed", str(seed)])
    record = json.loads(open(files["train"]).readline())
    assert record["label"] == "quality:4" and len(record["responses"]) == 4
    assert set(record["responses"][0]) >= {"value", "log(P(a|x,y))", "log(P(y|x))", "log(Q(y|a,x))"}
    log_dir = tmp_path / "run"
    proc = run_script("train_steerlm2.py", [
        f"model.restore_from_path={model}", "model.data.chat=True", f"model.data.train_ds.file_path={files['train']}",
        f"model.data.validation_ds.file_path={files['val']}", "model.data.train_ds.global_batch_size=16",
        "model.data.train_ds.micro_batch_size=1", "model.data.validation_ds.global_batch_size=16",
        "model.data.validation_ds.micro_batch_size=1", "model.steerlm2.micro_batch_size=32",
        "model.steerlm2.forward_micro_batch_size=64", f"exp_manager.explicit_log_dir={log_dir}",
        "trainer.sft.max_epochs=1", "trainer.sft.val_check_interval=36", "trainer.sft.val_at_start=True",
        "model.optim.lr=1e-4", "model.optim.sched.name=Constant", "exp_manager.create_checkpoint_callback=True",
        f"model.seed={seed}"])
    assert "SteerLM 2.0 finished: 36 steps" in proc.stdout
    distance = {r["step"]: r["val/distance"] for r in read_metrics(log_dir) if "val/distance" in r}
    before = steerlm_scores
    after = _quality_scores(log_dir / "checkpoints" / "megatron_gpt_sft.nemo", inputs["val"], tmp_path / "after.jsonl")
    print(f"SteerLM 2.0 (seed {seed}): held-out distance {distance}; greedy task score by asked quality {before} -> "
          f"{after}")
    assert sorted(distance) == [0, 36] and distance[36] < distance[0] + 0.05, distance
    # CPU, three seeds: the gap widens from 0.30 by 0.09 to 0.23
    assert after[4] - after[0] > before[4] - before[0] + 0.05, (before, after)
    if seed == 1234:  # the same training from Python, two steps
        from nemo_aligner.api import create_trainer

        trainer = create_trainer("steerlm2", model=model, batch_size=8, micro_batch_size=32, learning_rate=1e-4,
                                 max_sequence_length=64, output_dir=str(tmp_path / "api"))
        result = trainer.fit(str(files["train"]), val_dataset=str(files["val"]), max_steps=2)
        assert result.total_steps == 2 and trainer.model_path.endswith(".nemo") and trainer.model_path != model


def test_pipeline_parallel_matches_one_process(tmp_path, weak_policy):
    """Two steps at pipeline parallel 2 (the baseline's forward on the last stage, broadcast) give the
    losses and distances of one process."""
    import random

    rng = random.Random(0)
    records = []
    model, data_files = weak_policy
    for line in open(data_files["sft_train"]).readlines()[:64]:
        r = json.loads(line)
        values = [r["output"], r["output"][::-1], r["output"][1:], r["output"] + "a"]
        records.append({"system": "", "prompt_turns": [{"from": "User", "value": r["input"]}], "label": "quality:4",
                        "responses": [{"from": "Assistant", "value": v, "log(P(a|x,y))": rng.uniform(-3, 0),
                                       "log(P(y|x))": rng.uniform(-9, 0), "log(Q(y|a,x))": rng.uniform(-9, 0)}
                                      for v in values]})
    data = tmp_path / "s2.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))

    def run(name, *extra, **kwargs):
        run_script("train_steerlm2.py", [
            f"model.restore_from_path={model}", "model.data.chat=True", f"model.data.train_ds.file_path={data}",
            f"model.data.validation_ds.file_path={data}", "model.data.train_ds.global_batch_size=8",
            "model.data.train_ds.micro_batch_size=1", "model.data.validation_ds.global_batch_size=8",
            "model.data.validation_ds.micro_batch_size=1", "model.steerlm2.micro_batch_size=8",
            "model.steerlm2.forward_micro_batch_size=16", f"exp_manager.explicit_log_dir={tmp_path / name}",
            "trainer.sft.max_steps=2", "trainer.sft.val_check_interval=2", "trainer.sft.limit_val_batches=1",
            "model.optim.lr=1e-3", *extra], **kwargs)
        return [(r["train/loss"], r["train/distance"]) for r in read_metrics(tmp_path / name) if "train/loss" in r]

    one = run("one")
    two = run("pp2", "trainer.devices=2", "model.pipeline_model_parallel_size=2", like_nproc=2)
    assert len(one) == 2 and np.allclose(one, two, rtol=1e-4, atol=1e-6), (one, two)


def test_generator_refuses_what_it_cannot_score(tmp_path, quick_sft, quick_regression_rm):
    """Before any model is loaded: a label asking for an attribute the reward model does not predict,
    and a reward model that is not a per-attribute regression model; one ``error:`` line, no file."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "sort cab ="}) + "\n")
    rm = f"{quick_regression_rm}/checkpoints/megatron_gpt.nemo"
    for labels, reward_model, message in (
            ("helpfulness:4", rm, "error: label 'helpfulness:4': ['helpfulness'] not among the reward model's "
                                  "attributes ['quality', 'verbosity']"),
            ("quality:4", quick_sft, "needs a regression reward model with one output per attribute")):
        proc = run_python(GENERATOR, ["--input-file", str(prompts), "--output-file", str(tmp_path / "out.jsonl"),
                                      "--labels", labels, "--steerlm-model", quick_sft, "--sft-model", quick_sft,
                                      "--reward-model", reward_model], check=False)
        assert proc.returncode == 1 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]
        assert not (tmp_path / "out.jsonl").exists()
