"""Knowledge distillation: the top-k KL losses against a hand computation, the student model's loss
against one computed from its own logits, compute_topk_logits.py's records (exact top-k of the
teacher, resumable after a kill, the same under data parallel 2), bad records, and students whose
KL to the teacher falls."""

import json
import math
import os
import re

import numpy as np
import pytest
import torch

from conftest import SCRIPTS, read_metrics, run_python, run_script
from nemo_aligner.utils.errors import DataError
from nemo_aligner.utils.kd_losses import topk_kd_loss

TOPK_SCRIPT = os.path.join(os.path.dirname(SCRIPTS), "synthetic_data_gen", "compute_topk_logits.py")


def softmax(x):
    e = [math.exp(v - max(x)) for v in x]
    return [v / sum(e) for v in e]


def test_topk_kl_losses_by_hand():
    teacher = torch.tensor([[3.0, 1.0, 0.5], [0.2, 0.1, -2.0]])
    student = torch.tensor([[1.0, 2.0, 0.0], [0.0, 0.0, 0.0]])
    for kind in ("fwd_kl", "bwd_kl"):
        got = topk_kd_loss(student, teacher, kind)
        for row in range(2):
            p, q = softmax(teacher[row].tolist()), softmax(student[row].tolist())
            a, b = (p, q) if kind == "fwd_kl" else (q, p)
            assert got[row].item() == pytest.approx(sum(x * math.log(x / y) for x, y in zip(a, b)), rel=1e-6), kind
    assert topk_kd_loss(teacher, teacher).abs().max() < 1e-6  # no distance to itself
    with pytest.raises(ValueError, match="kd_loss='mse' must be one of"):
        topk_kd_loss(student, teacher, "mse")


def test_student_loss_from_its_own_logits(mcore_single):
    """KD x 0.7 + SFT x 0.3 with scaled logits, masked per token, two micro-batches averaged."""
    from omegaconf import OmegaConf

    from conftest import TINY_ARCH, forward_logits
    from nemo_aligner.models.nlp.gpt.megatron_gpt_knowledge_distillation import MegatronGPTKnowledgeDistillationModel
    from nemo_aligner.utils.tokenizers import ByteTokenizer

    torch.manual_seed(5)
    cfg = OmegaConf.create(dict(TINY_ARCH, micro_batch_size=2, global_batch_size=4, encoder_seq_length=32,
                                knowledge_distillation={"kd_loss": "bwd_kl", "kd_loss_weight": 0.7,
                                                        "sft_loss_weight": 0.3, "target_logits_scale": 0.5,
                                                        "logits_scale": 2.0}))
    model = MegatronGPTKnowledgeDistillationModel(cfg, ByteTokenizer())
    tokens, labels = torch.randint(3, 200, (4, 10)), torch.randint(3, 200, (4, 10))
    mask = torch.zeros(4, 10)
    mask[0, 3:] = mask[1, 5:8] = mask[2, 1:] = mask[3, 9:] = 1
    ids = torch.randint(0, 256, (4, 10, 3))
    teacher = torch.sort(torch.randn(4, 10, 3), dim=-1, descending=True).values
    batch = {"tokens": tokens, "labels": labels, "loss_mask": mask, "topk_token_ids": ids, "topk_logits": teacher,
             "position_ids": torch.arange(10).expand(4, 10)}
    loss, metrics = model.get_loss_and_metrics(batch, forward_only=True)
    logits = forward_logits(model, tokens).double() * 2.0
    per_token = []
    for b in range(4):
        row = []
        for t in range(10):
            q = torch.softmax(logits[b, t, ids[b, t]], -1)
            p = torch.softmax(teacher[b, t].double() * 0.5, -1)
            kl = float((q * (q.log() - p.log())).sum())
            nll = float(-torch.log_softmax(logits[b, t], -1)[labels[b, t]])
            row.append((kl, nll))
        per_token.append(row)
    def mb_loss(rows):
        num = sum(0.7 * per_token[b][t][0] + 0.3 * per_token[b][t][1] for b in rows for t in range(10) if mask[b, t])
        return num / float(mask[rows].sum())
    assert loss == pytest.approx((mb_loss([0, 1]) + mb_loss([2, 3])) / 2, rel=1e-5)
    kd = sum(per_token[b][t][0] for b in range(4) for t in range(10) if mask[b, t]) / float(mask.sum())
    assert metrics["kd_loss"] == pytest.approx(kd, rel=1e-5)


def assert_same_topk(ids_a, logits_a, ids_b, logits_b):
    """Equal top-k lists: logits within 1e-5; ids in the same order, except that logits within 1e-4 of
    each other (a near tie that another batch's padding may order either way) may swap."""
    np.testing.assert_allclose(logits_a, logits_b, rtol=1e-5, atol=1e-5)
    for pos, (ia, ib, la) in enumerate(zip(ids_a, ids_b, logits_a)):
        if ia != ib:
            tied = [abs(la[j] - la[j + 1]) < 1e-4 for j in range(len(la) - 1)]
            groups, start = [], 0
            for j, t in enumerate(tied + [False]):
                if not t:
                    groups.append((start, j + 1))
                    start = j + 1
            assert all(sorted(ia[x:y]) == sorted(ib[x:y]) for x, y in groups), (pos, ia, ib, la)


def _compute(teacher, data_file, output, *extra, **kwargs):
    return run_python(TOPK_SCRIPT, [f"pretrained_checkpoint.restore_from_path={teacher}",
                                    f"data.data.file_path={data_file}", f"output_path={output}", "top_k=4",
                                    "model.global_batch_size=16", "model.micro_batch_size=8", *extra], **kwargs)


@pytest.fixture(scope="module")
def kd_records(tmp_path_factory, weak_policy):
    """The weak SFT policy's top-4 logits over 512 training and the 64 validation samples."""
    teacher, data = weak_policy
    out = tmp_path_factory.mktemp("kd")
    _compute(teacher, data["sft_train"], out / "train.jsonl", "end_at_idx=511", "model.global_batch_size=128",
             "model.micro_batch_size=64")
    _compute(teacher, data["sft_val"], out / "val.jsonl")
    return teacher, str(out / "train.jsonl"), str(out / "val.jsonl")


def test_topk_records_are_the_teachers_and_survive_a_kill(tmp_path, kd_records, weak_policy, mcore_single):
    """Each record holds the teacher's exact top-4 logits and ids at every position (largest first)
    and its logsumexp; a file cut mid-record (a killed run) is completed to the same file; data
    parallel 2 writes the same records."""
    from omegaconf import OmegaConf

    from conftest import forward_logits
    from nemo_aligner.models.nlp.gpt.loading import load_model
    from nemo_aligner.models.nlp.gpt.megatron_gpt_model import MegatronGPTModel

    teacher, _, val = kd_records
    data = weak_policy[1]
    records = [json.loads(line) for line in open(val)]
    assert [r["index"] for r in records] == list(range(64))
    model = load_model(MegatronGPTModel, OmegaConf.create({}), "32", teacher, trainable=False)
    model.eval()
    sft = [json.loads(line) for line in open(data["sft_val"])]
    for r, s in zip(records[:8], sft):
        ids = model.tokenizer.text_to_ids(f"{s['input']} {s['output']}") + [model.tokenizer.eos_id]
        assert r["tokens"] == ids[:-1] and r["labels"] == ids[1:]
        assert sum(r["loss_mask"]) == len(model.tokenizer.text_to_ids(s["output"])) + 1  # the answer and EOS
        logits = forward_logits(model, torch.tensor([r["tokens"]]))[0, :, :model.tokenizer.vocab_size]
        values, top = torch.topk(logits, 4, dim=-1)
        assert_same_topk(r["topk_token_ids"], r["topk_logits"], top.tolist(), values.tolist())
        np.testing.assert_allclose(r["log_sum_exp_logits"], torch.logsumexp(logits, -1).numpy(), rtol=1e-5, atol=1e-5)
    # a run stopped mid-write: 30 whole records and half of the 31st
    cut = tmp_path / "cut.jsonl"
    lines = open(val, "rb").read().split(b"\n")
    cut.write_bytes(b"\n".join(lines[:30]) + b"\n" + lines[30][: len(lines[30]) // 2])
    proc = _compute(teacher, data["sft_val"], cut)
    out = proc.stdout + proc.stderr
    assert "Top-4 logits of 34 samples written" in out and "cut.jsonl:31: an unfinished record" in out, out[-2000:]
    assert "top-k logits:" not in out  # progress every 30 s, not a line per global batch (3 batches here)
    resumed = [json.loads(line) for line in open(cut)]
    assert [r["index"] for r in resumed] == list(range(64))
    for a, b in zip(resumed, records):
        assert a["tokens"] == b["tokens"]
        assert_same_topk(a["topk_token_ids"], a["topk_logits"], b["topk_token_ids"], b["topk_logits"])
    five = tmp_path / "five.jsonl"  # a last block of 5 samples with micro-batches of 2
    _compute(teacher, data["sft_val"], five, "end_at_idx=4", "model.global_batch_size=6", "model.micro_batch_size=2")
    assert [json.loads(line)["index"] for line in open(five)] == list(range(5))
    dp2 = tmp_path / "dp2.jsonl"
    _compute(teacher, data["sft_val"], dp2, "trainer.devices=2", "end_at_idx=19", like_nproc=2)
    two = [json.loads(line) for line in open(dp2)]
    assert [r["index"] for r in two] == list(range(20))
    for a, b in zip(two, records):
        assert_same_topk(a["topk_token_ids"], a["topk_logits"], b["topk_token_ids"], b["topk_logits"])


def _distill(student, train, val, log_dir, *extra, steps=60, val_at_start=True, **kwargs):
    return run_script("train_gpt_knowledge_distillation.py", [
        f"pretrained_checkpoint.restore_from_path={student}",
        f"model.data.data_prefix={{train: [{train}], validation: [{val}]}}", f"exp_manager.explicit_log_dir={log_dir}",
        f"trainer.knowledge_distillation.max_steps={steps}", "trainer.knowledge_distillation.max_epochs=100",
        f"trainer.knowledge_distillation.val_check_interval={steps}",
        f"trainer.knowledge_distillation.val_at_start={val_at_start}",
        "model.global_batch_size=32", "model.micro_batch_size=16", "model.optim.lr=1e-3",
        "model.optim.sched.name=Constant", *extra], **kwargs)


@pytest.mark.learning
@pytest.mark.parametrize("seed, kind", [(1234, "fwd_kl"), (7, "fwd_kl"), (11, "bwd_kl")])
def test_student_kl_to_the_teacher_falls(tmp_path, kd_records, base_nemo, seed, kind):
    """A randomly initialised student, 60 steps on the teacher's top-4 logits: its held-out KL to the
    teacher (over the teacher's top 4) falls by more than a third, for 3 seeds (one with the reverse KL)."""
    _, train, val = kd_records
    proc = _distill(base_nemo[0], train, val, tmp_path / "kd", f"model.seed={seed}",
                    f"model.knowledge_distillation.kd_loss={kind}")
    val_kl = {r["step"]: r["val/kd_loss"] for r in read_metrics(tmp_path / "kd") if "val/kd_loss" in r}
    print(f"KD {kind} seed {seed}: held-out KL to the teacher {val_kl}")
    assert sorted(val_kl) == [0, 60] and val_kl[60] < 0.67 * val_kl[0], val_kl
    assert "Knowledge distillation finished: 60 steps" in proc.stdout


def test_tp2_matches_one_process(tmp_path, kd_records, base_nemo):
    """Tensor parallel 2 (the teacher's ids gathered from both vocabulary halves): the same losses as one process."""
    _, train, val = kd_records
    extra = ["model.knowledge_distillation.sft_loss_weight=0.5"]
    _distill(base_nemo[0], train, val, tmp_path / "one", *extra, steps=2, val_at_start=False)
    _distill(base_nemo[0], train, val, tmp_path / "two", *extra, "trainer.devices=2", "model.tensor_model_parallel_size=2",
             steps=2, val_at_start=False, like_nproc=2)

    def losses(d):
        return [(r["train/kd_loss"], r["train/sft_loss"]) for r in read_metrics(d) if "train/kd_loss" in r]

    one, two = losses(tmp_path / "one"), losses(tmp_path / "two")
    assert len(one) == 2 and np.allclose(one, two, rtol=1e-4), (one, two)


BAD_RECORDS = {
    "missing": (lambda r: r.pop("topk_token_ids"), r"kd\.jsonl:1: missing \['topk_token_ids'\]"),
    "unsorted": (lambda r: r["topk_logits"][0].reverse(), r"kd\.jsonl:1: topk_logits must be sorted largest first"),
    "id-outside-vocab": (lambda r: r["topk_token_ids"][0].__setitem__(0, 10 ** 6),
                         r"kd\.jsonl:1: topk_token_ids must be token ids in 0\.\.\d+"),
    "short-labels": (lambda r: r["labels"].pop(), r"kd\.jsonl:1: labels must be a list of \d+ entries"),
    "ragged": (lambda r: r["topk_logits"][1].pop(), r"kd\.jsonl:1: topk_logits/topk_token_ids must be rectangular"),
}


@pytest.mark.parametrize("case", sorted(BAD_RECORDS))
def test_bad_records_name_file_and_line(tmp_path, case):
    from nemo_aligner.data.nlp.kd_dataset import KnowledgeDistillationDataset

    record = {"tokens": [5, 6, 7], "labels": [6, 7, 8], "loss_mask": [0, 1, 1],
              "topk_logits": [[2.0, 1.0], [3.0, 0.5], [1.0, 1.0]], "topk_token_ids": [[6, 9], [7, 1], [8, 2]]}
    edit, message = BAD_RECORDS[case]
    edit(record)
    path = tmp_path / "kd.jsonl"
    path.write_text(json.dumps(record) + "\n")
    with pytest.raises(DataError, match=message):
        KnowledgeDistillationDataset([str(path)], 259, 32)


def test_top_k_larger_than_the_records_is_refused_by_the_script(tmp_path, kd_records, base_nemo):
    _, train, val = kd_records
    proc = _distill(base_nemo[0], train, val, tmp_path / "x", "model.data.top_k=8", steps=1, check=False)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert re.search(r"error: .*train\.jsonl:1: has 4 teacher logits per token; model\.data\.top_k=8 asks for more",
                     proc.stderr), proc.stderr[-2000:]


def test_topk_scripts_own_config_checks_its_values(tmp_path):
    """compute_topk_logits.py's config lives outside examples/nlp/gpt/conf: its true/false keys are still
    checked against it (``data.chat=2`` read as true, then a missing-field error on the first record)."""
    proc = _compute(tmp_path / "missing.nemo", tmp_path / "data.jsonl", tmp_path / "out.jsonl", "data.chat=2", check=False)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == "error: data.chat=2 must be true or false", proc.stderr[-2000:]


def test_python_api_distils(tmp_path, kd_records, base_nemo):
    from nemo_aligner.api import create_trainer, list_algorithms
    from nemo_aligner.utils.errors import ConfigError

    _, train, val = kd_records
    assert "kd" in list_algorithms()
    trainer = create_trainer("kd", model=base_nemo[0], batch_size=16, learning_rate=1e-3, top_k=2,
                             max_sequence_length=32, output_dir=str(tmp_path / "api"))
    result = trainer.fit(dataset=train, val_dataset=val, max_steps=3)
    assert result.total_steps == 3 and trainer.model_path.endswith(".nemo") and trainer.model_path != base_nemo[0]
    with pytest.raises(ConfigError, match="kd.top_k=0 must be >= 1"):
        create_trainer("kd", model=base_nemo[0], top_k=0)


def test_nemo_aligners_chunked_command(tmp_path, kd_records, base_nemo):
    """NeMo-Aligner's documented student command: chunked_jsonl records (CHUNK_ID in the paths,
    n_chunks, n_examples_per_chunk, splits_string) read as chunks 0..n_chunks-1 that exist."""
    _, train, val = kd_records
    lines = open(train).read().splitlines(keepends=True)
    for i, part in enumerate((lines[:300], lines[300:])):
        (tmp_path / f"train_with_logits_{i}.jsonl").write_text("".join(part))
    (tmp_path / "val_with_logits_0.jsonl").write_text(open(val).read())
    chunked = str(tmp_path / "train_with_logits_CHUNK_ID.jsonl")
    proc = run_script("train_gpt_knowledge_distillation.py", [
        f"pretrained_checkpoint.restore_from_path={base_nemo[0]}", "trainer.knowledge_distillation.max_steps=2",
        "trainer.knowledge_distillation.val_check_interval=1000", "trainer.knowledge_distillation.save_interval=1000",
        "model.megatron_amp_O2=True", "++model.tensor_model_parallel_size=1", "++model.pipeline_model_parallel_size=1",
        "model.micro_batch_size=1", "model.global_batch_size=8", "model.optim.lr=1e-5", "model.optim.weight_decay=0.01",
        "model.optim.sched.constant_steps=0", "model.knowledge_distillation.sft_loss_weight=0.4",
        "model.knowledge_distillation.kd_loss_weight=1", "model.knowledge_distillation.kd_loss=fwd_kl",
        f"model.data.data_prefix={{train: [{chunked}], validation: [{tmp_path}/val_with_logits_CHUNK_ID.jsonl], "
        f"test: [{tmp_path}/val_with_logits_CHUNK_ID.jsonl]}}",
        "++model.data.data_impl=chunked_jsonl", "++model.data.n_chunks=3",
        "++model.data.n_examples_per_chunk={train: 300, validation: 64, test: 64}", "++model.data.seq_length=64",
        "model.data.splits_string='98,1,1'", f"exp_manager.explicit_log_dir={tmp_path / 'run'}",
        "exp_manager.checkpoint_callback_params.save_nemo_on_train_end=True"])
    out = proc.stdout + proc.stderr
    assert "512 training and 64 validation examples" in out  # both chunks that exist (of 3), every record
    assert "train_with_logits_1.jsonl: 212 records; model.data.n_examples_per_chunk says 300" in out
    assert (tmp_path / "run" / "checkpoints" / "megatron_gpt_knowledge_distillation.nemo").is_file()


def test_chunked_jsonl_without_n_chunks_is_one_line(tmp_path):
    """NeMo-Aligner's gpt_knowledge_distillation.yaml sets data_impl=chunked_jsonl with n_chunks null (its
    script fails on range(None)): one line naming the key and the way out."""
    from omegaconf import OmegaConf

    from nemo_aligner.data.nlp.reward_datasets import data_prefix_paths
    from nemo_aligner.utils.errors import ConfigError

    cfg = OmegaConf.create({"data_impl": "chunked_jsonl", "n_chunks": None,
                            "data_prefix": {"train": [str(tmp_path / "t_CHUNK_ID.jsonl")]}})
    with pytest.raises(ConfigError, match=r"^model\.data\.n_chunks=null must be >= 1 with model\.data\.data_impl="
                                          r"chunked_jsonl \(files with CHUNK_ID replaced by 0 \.\. n_chunks-1\); one "
                                          r"whole file per split: model\.data\.data_impl=jsonl$"):
        data_prefix_paths(cfg, "train", chunks=True)
    cfg.n_chunks = {"train": 0}
    with pytest.raises(ConfigError, match=r"n_chunks=\{'train': 0\} must be >= 1"):
        data_prefix_paths(cfg, "train", chunks=True)


def test_nemo_aligners_teacher_command_on_chat_data(tmp_path, weak_policy):
    """NeMo-Aligner's documented compute_topk_logits.py command (sizes and paths changed) parses as it is:
    chat data renders with its default turn strings (``<extra_id_1>User``), and the keys of its config
    that change nothing for a forward pass are named in a warning."""
    from nemo_aligner.utils.tokenizers import ByteTokenizer

    teacher, data = weak_policy
    out = tmp_path / "train_with_logits_0.jsonl"
    proc = run_python(TOPK_SCRIPT, [
        "trainer.num_nodes=1", "trainer.devices=1", f"pretrained_checkpoint.restore_from_path={teacher}",
        "model.megatron_amp_O2=True", "model.tensor_model_parallel_size=1", "data.chat=True", "data.sample=True",
        "data.num_workers=0", "data.data.max_seq_length=64", f"data.data.file_path={data['chat_val']}",
        "data.data.add_eos=False", "data.data.hf_dataset=True", "top_k=4", "model.global_batch_size=16",
        "model.micro_batch_size=2", "start_from_idx=0", "end_at_idx=3", f"output_path={out}",
        "model.restore_from_path=other.nemo", "model.answer_only_loss=True", "model.use_flash_attention=True"])
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["index"] for r in records] == [0, 1, 2, 3]
    tok, ids = ByteTokenizer(), records[0]["tokens"] + [records[0]["labels"][-1]]

    def starts_at(part: str) -> list:
        sub = tok.text_to_ids(part)  # <extra_id_N> is one special token, as in NeMo's tokenizers
        return [i for i in range(len(ids) - len(sub) + 1) if ids[i:i + len(sub)] == sub]

    assert starts_at("<extra_id_0>System\n") == [0] and starts_at("<extra_id_1>User\n")
    assert starts_at("<extra_id_1>Assistant\n") and not starts_at("\x11"), tok.ids_to_text(ids)
    for key in ("model.restore_from_path", "model.answer_only_loss", "model.use_flash_attention"):
        assert f"{key} is accepted for NeMo-Aligner's commands but changes nothing here" in proc.stdout + proc.stderr, key
