"""Sequence packing: the packing algorithms, NeMo's and NeMo-Aligner's .npy formats (read without running
pickled code), and packed batches whose SFT and DPO losses equal the unpacked ones."""

import os

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from conftest import REPO, TINY_ARCH, TINY_GPT2_ARCH, run_python, run_script
from nemo_aligner.data.nlp import packing
from nemo_aligner.utils.errors import DataError
from nemo_aligner.utils.tokenizers import ByteTokenizer


def test_first_fit_by_hand():
    lengths = [5, 7, 3, 4, 6, 2]
    # in order: 5 -> A(5); 7 -> B(7); 3 -> A(8); 4 -> C(4); 6 -> C(10); 2 -> A(10)
    assert packing.first_fit(lengths, 10) == [[0, 2, 5], [1], [3, 4]]
    # decreasing: 7 A; 6 B; 5 C; 4 B(10); 3 A(10); 2 C(7)
    assert packing.pack_assignments(lengths, 10, "first_fit_decreasing") == [[1, 2], [4, 3], [0, 5]]
    shuffled = packing.pack_assignments(lengths, 10, "first_fit_shuffle", seed=3)
    assert sorted(i for p in shuffled for i in p) == list(range(6))
    assert all(sum(lengths[i] for i in p) <= 10 for p in shuffled)
    assert shuffled == packing.pack_assignments(lengths, 10, "first_fit_shuffle", seed=3)
    with pytest.raises(DataError, match="sample 1 has 7 tokens, more than pack_size=6"):
        packing.first_fit(lengths, 6)


def test_block_causal_mask_and_sequence_sums():
    segments = torch.tensor([[0, 0, 1, 1, 1, 2]])
    visible = ~packing.block_causal_mask(segments)[0, 0]
    expected = torch.tensor([[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [0, 0, 1, 0, 0, 0], [0, 0, 1, 1, 0, 0],
                             [0, 0, 1, 1, 1, 0], [0, 0, 0, 0, 0, 1]], dtype=torch.bool)
    assert torch.equal(visible, expected)
    values = torch.tensor([[1.0, 2.0, 3.0, 4.0, 0.0], [5.0, 6.0, 7.0, 0.0, 0.0]])
    sequence = torch.tensor([[0, 0, 1, 1, -1], [0, 1, 1, -1, -1]])
    assert packing.sequence_sums(values, sequence, torch.tensor([2, 2])).tolist() == [3.0, 7.0, 5.0, 13.0]


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned > /dev/null",))


def test_packed_npy_round_trip_and_refusals(tmp_path):
    records = packing.pack_sft_samples([{"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]},
                                        {"input_ids": [4, 5], "loss_mask": [0, 1]}], 8, "first_fit_decreasing", 0)
    path = packing.save_packed_records(str(tmp_path / "p.npy"), records)
    assert packing.load_packed_records(path, "k") == records
    assert np.load(path, allow_pickle=True)[0]["seq_start_id"] == [0, 3]  # NeMo's reader sees its format
    evil = tmp_path / "evil.npy"
    array = np.empty(1, dtype=object)
    array[0] = {"input_ids": _Evil()}
    np.save(evil, array, allow_pickle=True)
    with pytest.raises(DataError, match=r"evil\.npy: not a packed \.npy data file \(posix\.system is not allowed"):
        packing.load_packed_records(str(evil), "model.data.data_prefix.train")
    np.save(tmp_path / "ints.npy", np.arange(4))
    with pytest.raises(DataError, match=r"ints\.npy: holds a int64 array, not packed records"):
        packing.load_packed_records(str(tmp_path / "ints.npy"), "k")
    (tmp_path / "text.npy").write_text('{"prompt": "x"}\n')
    with pytest.raises(DataError, match=r"text\.npy: not a packed \.npy data file"):
        packing.load_packed_records(str(tmp_path / "text.npy"), "k")
    with pytest.raises(DataError, match=r"p\.npy: pack 0: sequence boundaries"):
        bad = dict(records[0], seq_start_id=[0, 4])
        packing.check_packed_record(bad, "p.npy: pack 0", "sft", 64, 256)
    with pytest.raises(DataError, match=r"token id 300 is outside the tokenizer's vocabulary"):
        packing.check_packed_record(dict(records[0], input_ids=[300, 2, 3, 4, 5]), "p.npy: pack 0", "sft", 64, 256)


def _model(cls, arch, **section):
    torch.manual_seed(0)
    cfg = OmegaConf.create(dict(arch, micro_batch_size=2, global_batch_size=4, encoder_seq_length=128,
                                max_position_embeddings=128, **section,
                                optim={"name": "fused_adam", "lr": 1e-2, "sched": {"name": "Constant"}}))
    return cls(cfg, ByteTokenizer(), trainable=False)


@pytest.mark.stack
@pytest.mark.parametrize("arch", [TINY_ARCH, TINY_GPT2_ARCH], ids=["rope", "learned-positions"])
def test_packed_sft_loss_equals_unpacked(mcore_single, builtin_data, arch):
    from nemo_aligner.data.nlp.builders import build_sft_dataset, sft_collate_fn
    from nemo_aligner.models.nlp.gpt.gpt_sft_model import GPTSFTModel

    model = _model(GPTSFTModel, arch)
    ds = build_sft_dataset(OmegaConf.create({"file_path": builtin_data["sft_val"]}), model.tokenizer, 64, False, True)
    samples = [ds[i] for i in range(10)]
    collate = sft_collate_fn(model.tokenizer, 128)
    model.micro_batch_size = model.val_micro_batch_size = 10
    model.prepare_for_validation_step()
    _, plain = model.get_loss_and_metrics(collate(samples), forward_only=True)
    packs = packing.pack_sft_samples([{"input_ids": s["input_ids"],
                                       "loss_mask": [i >= s["answer_start"] for i in range(len(s["input_ids"]))]}
                                      for s in samples], 128, "first_fit_shuffle", 0)
    assert len(packs) < len(samples) / 2
    checked = [packing.check_packed_record(p, f"pack {i}", "sft", 128, model.tokenizer.vocab_size) for i, p in enumerate(packs)]
    model.val_micro_batch_size = 1  # a pack per micro-batch
    model.prepare_for_validation_step()
    _, packed = model.get_loss_and_metrics(collate(checked), forward_only=True)
    assert packed["tokens"] == plain["tokens"] > 0
    assert packed["token_loss"] == pytest.approx(plain["token_loss"], rel=1e-5)


@pytest.mark.parametrize("arch,dpo", [
    (TINY_ARCH, {"sft_loss_weight": 0.5}),
    (TINY_GPT2_ARCH, {"preference_average_log_probs": True, "preference_loss": "rpo_sq"}),
], ids=["rope-dpo-sft", "learned-positions-rpo-average"])
def test_packed_dpo_loss_equals_unpacked(mcore_single, builtin_data, arch, dpo):
    from nemo_aligner.data.nlp.dpo_dataset import DPOPairDataset, collate_dpo
    from nemo_aligner.models.nlp.gpt.megatron_gpt_dpo_model import MegatronGPTDPOModel

    model = _model(MegatronGPTDPOModel, arch, dpo=dict(ref_policy_kl_penalty=0.3, **dpo))
    model.snapshot_reference_policy()
    with torch.no_grad():  # the policy moves away from the reference: non-zero log-ratios
        for p in model.module.parameters():
            p.add_(0.02 * torch.randn_like(p))
    ds = DPOPairDataset([builtin_data["dpo_val"]], model.tokenizer, 64)
    samples = [ds[i] for i in range(8)]
    for i, s in enumerate(samples):  # distinct rewards: RPO reads them
        s["rewards"] = [1.0 + 0.1 * i, -0.2 * i]
    model.micro_batch_size = 8
    model.eval()
    _, plain = model.get_loss_and_metrics(collate_dpo(samples, model.tokenizer.eos_id, 64), forward_only=True)
    packs = packing.pack_dpo_samples(samples, 128, "first_fit_shuffle", 0)
    checked = [packing.check_packed_record(p, f"pack {i}", "dpo", 128, model.tokenizer.vocab_size) for i, p in enumerate(packs)]
    model.micro_batch_size = 1  # a pack per micro-batch: a pair is never split across micro-batches
    _, packed = model.get_loss_and_metrics(packing.collate_packs(checked, model.tokenizer.eos_id, 128), True)
    assert packed["pairs"] == plain["pairs"] == 8
    for key in ("loss", "preference_loss", "sft_loss", "accuracy", "rewards_chosen_mean", "rewards_rejected_mean"):
        assert packed[key] == pytest.approx(plain[key], rel=1e-5, abs=1e-6), key
    assert abs(plain["reward_margin"]) > 1e-3


def test_packing_scripts_and_packed_training(tmp_path, builtin_data, base_nemo):
    out = tmp_path / "packed"
    run_python(os.path.join(REPO, "examples", "nlp", "data", "sft", "prepare_packed_ft_dataset.py"), [
        f"model.data.train_ds.file_names=[{builtin_data['sft_train']}]", "model.data.train_ds.max_seq_length=64",
        f"+output_dir={out}", "+pack_sizes=[128]", f"+tokenizer_path={base_nemo[0]}"])
    proc = run_python(os.path.join(REPO, "examples", "nlp", "data", "dpo", "prepare_packed_dpo_dataset.py"), [
        f"model.data.data_prefix={builtin_data['dpo_train']}", "model.encoder_seq_length=64", f"+output_dir={out}",
        "+pack_sizes=[128]", "+packing_algorithm=first_fit_decreasing"])
    assert "samples per pack" in proc.stdout
    sft_packs = np.load(out / "packed_128_seed0.npy", allow_pickle=True)
    dpo_packs = np.load(out / "packed_128_seed1234.npy", allow_pickle=True)
    assert set(sft_packs[0]) == {"input_ids", "loss_mask", "seq_start_id"}
    assert set(dpo_packs[0]) == {"input_ids", "labels", "reward", "lengths", "seq_boundaries"}
    assert sum(len(p["seq_boundaries"]) - 1 for p in dpo_packs) == 2 * 640  # every pair, both responses

    log_dir = tmp_path / "dpo"
    run_script("train_gpt_dpo.py", [
        f"pretrained_checkpoint.restore_from_path={base_nemo[0]}", "++model.data.data_impl=packed_jsonl",
        f"++model.data.data_prefix={{train: [{out / 'packed_128_seed1234.npy'}]}}", "model.encoder_seq_length=128",
        f"exp_manager.explicit_log_dir={log_dir}", "trainer.dpo.max_steps=2", "model.global_batch_size=4",
        "model.micro_batch_size=2"])
    sft_dir = tmp_path / "sft"
    run_script("train_gpt_sft.py", [
        f"model.restore_from_path={base_nemo[0]}", f"model.data.train_ds.file_path={out / 'packed_128_seed0.npy'}",
        "model.data.train_ds.packed_sequence=True", f"model.data.validation_ds.file_path={builtin_data['sft_val']}",
        "model.encoder_seq_length=128", "model.data.train_ds.global_batch_size=4", "model.data.train_ds.micro_batch_size=2",
        f"exp_manager.explicit_log_dir={sft_dir}", "trainer.sft.max_steps=2"])
    from nemo_aligner.data.nlp.reward_datasets import data_prefix_paths
    from nemo_aligner.utils.errors import ConfigError

    jsonl = OmegaConf.create({"data_impl": "packed_jsonl", "data_prefix": {"train": [builtin_data["dpo_train"]]}})
    with pytest.raises(ConfigError, match=r"model\.data\.data_prefix\.train: .*dpo_train\.jsonl is not a \.npy of packs"):
        data_prefix_paths(jsonl, "train", packs=True)
    with pytest.raises(ConfigError, match=r"model\.data\.data_impl=packed_jsonl is read by DPO only"):
        data_prefix_paths(jsonl, "train")


def test_packs_refuse_transformer_engine_attention(monkeypatch):
    """TE's causal kernels would ignore the block-diagonal mask: packed data asks for the local spec."""
    from types import SimpleNamespace

    from nemo_aligner.models.nlp.gpt import gpt_builder
    from nemo_aligner.recipes.prepare_packed import check_packed_attention
    from nemo_aligner.utils.errors import ConfigError

    monkeypatch.setattr(gpt_builder, "te_available", lambda: True)
    with pytest.raises(ConfigError, match=r"model\.data\.train_ds\.packed_sequence: packed sequences run on "
                                          r"megatron-core's local layer spec .* set model\.force_local_spec=True"):
        check_packed_attention(SimpleNamespace(cfg=OmegaConf.create({})), "model.data.train_ds.packed_sequence")
    check_packed_attention(SimpleNamespace(cfg=OmegaConf.create({"force_local_spec": True})), "k")
