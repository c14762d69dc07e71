"""KTO: the loss against a hand computation, the mismatched pairs of the KL estimate, the estimate
itself against the model's own log-probs, and KTO on the built-in data."""

import math

import pytest
import torch

from conftest import read_metrics, run_script, tiny_optim

from nemo_aligner.data.nlp.kto_dataset import KTODataset, collate_kto
from nemo_aligner.utils.errors import DataError
from nemo_aligner.utils.preference_losses import kto_loss, sequence_logps
from nemo_aligner.utils.tokenizers import ByteTokenizer


def sig(x):
    return 1 / (1 + math.exp(-x))


def test_kto_loss_by_hand():
    policy, ref = torch.tensor([-1.0, -2.0, -0.5]), torch.tensor([-1.5, -1.0, -0.5])
    desirable = torch.tensor([1.0, 0.0, 1.0])
    got = kto_loss(policy, ref, desirable, torch.tensor(0.1), beta=0.5, desirable_weight=1.0, undesirable_weight=2.0)
    expected = [1 - sig(0.5 * (0.5 - 0.1)), 2.0 * (1 - sig(0.5 * (0.1 - (-1.0)))), 1 - sig(0.5 * (0.0 - 0.1))]
    assert got.tolist() == pytest.approx(expected)
    # z is a detached reference point, clamped at 0
    negative = kto_loss(policy, ref, desirable, torch.tensor(-3.0), beta=0.5)
    assert negative.tolist() == pytest.approx(kto_loss(policy, ref, desirable, torch.tensor(0.0), beta=0.5).tolist())


def records(*triples):
    return [{"prompt": p, "response": r, "preference": pref, "__line__": i + 1, "__file__": "k.jsonl"}
            for i, (p, r, pref) in enumerate(triples)]


def test_collate_pairs_each_prompt_with_the_next_response():
    tok = ByteTokenizer()
    ds = KTODataset(None, tok, 32, records=records(("p1 ", "aa", "chosen"), ("q2 ", "bbb", "rejected"),
                                                    ("r3 ", "c", "chosen")))
    batch = collate_kto([ds[0], ds[1], ds[2], ds[-1]], tok, 32)  # the last is validation padding
    assert batch["desirable"].tolist() == [1.0, 0.0, 1.0, 0.0] and batch["weight"].tolist() == [1, 1, 1, 0]

    def decode(tokens, mask, row):
        response = tokens[row, 1:][mask[row].bool()].tolist()
        return tok.ids_to_text(response[:-1]), response[-1]

    for row, (prompt, response) in enumerate([("p1 ", "aa"), ("q2 ", "bbb"), ("r3 ", "c")]):
        assert decode(batch["tokens"], batch["mask"], row) == (response, tok.eos_id)
        assert tok.ids_to_text(batch["tokens"][row, :len(prompt)].tolist()) == prompt
    for row, (prompt, partner) in enumerate([("p1 ", "bbb"), ("q2 ", "c"), ("r3 ", "aa")]):  # cyclic, padding skipped
        assert decode(batch["kl_tokens"], batch["kl_mask"], row) == (partner, tok.eos_id)
        assert tok.ids_to_text(batch["kl_tokens"][row, :len(prompt)].tolist()) == prompt
    assert batch["mask"][3].sum() == 0 and batch["kl_mask"][3].sum() == 0
    assert collate_kto([ds[0]], tok, 32)["kl_weight"].tolist() == [0.0]  # no partner, no KL row
    with pytest.raises(DataError, match=r"k\.jsonl:1: field 'preference' must be \"chosen\" or \"rejected\", got 'good'"):
        KTODataset(None, tok, 32, records=records(("p", "r", "good")))
    with pytest.raises(DataError, match=r"k\.jsonl:1: missing field 'response'"):
        KTODataset(None, tok, 32, records=[{"prompt": "p", "preference": "chosen", "__line__": 1, "__file__": "k.jsonl"}])


def test_kl_estimate_is_the_mean_mismatched_log_ratio(mcore_single):
    from omegaconf import OmegaConf

    from conftest import TINY_ARCH
    from nemo_aligner.models.nlp.gpt.megatron_gpt_kto_model import MegatronGPTKTOModel

    torch.manual_seed(0)
    cfg = OmegaConf.create(dict(TINY_ARCH, micro_batch_size=2, global_batch_size=4, encoder_seq_length=32,
                                kto={"ref_policy_kl_penalty": 0.1}))
    tok = ByteTokenizer()
    model = MegatronGPTKTOModel(cfg, tok)
    model.snapshot_reference_policy()
    ds = KTODataset(None, tok, 32, records=records(*[(f"reverse {w} = ", w[::-1], "chosen") for w in
                                                      ["abc", "bcd", "cde", "defg"]]))
    batch = collate_kto([ds[i] for i in range(4)], tok, 32)
    assert model.kl_estimate(batch).item() == 0.0  # policy == reference
    with torch.no_grad():
        for p in model.module.parameters():
            p.add_(0.05 * torch.randn_like(p))
    diff = sequence_logps(model.token_logps(batch["kl_tokens"], 2) - model.token_logps(batch["kl_tokens"], 2, True),
                          batch["kl_mask"])
    assert model.kl_estimate(batch).item() == pytest.approx(max(diff.mean().item(), 0.0), rel=1e-5, abs=1e-6)
    assert diff.abs().max() > 1e-3  # the perturbation did change the log-probs


def test_kto_refuses_one_sample_per_data_parallel_rank(mcore_single):
    """One sample per rank has no mismatched partner: the KL estimate would be 0 throughout."""
    from omegaconf import OmegaConf

    from conftest import TINY_ARCH
    from nemo_aligner.models.nlp.gpt.megatron_gpt_kto_model import MegatronGPTKTOModel
    from nemo_aligner.utils.errors import ConfigError

    cfg = OmegaConf.create(dict(TINY_ARCH, micro_batch_size=1, global_batch_size=1, encoder_seq_length=32))
    with pytest.raises(ConfigError, match=r"model\.global_batch_size=1 gives 1 sample\(s\) per data-parallel rank"):
        MegatronGPTKTOModel(cfg, ByteTokenizer())
    MegatronGPTKTOModel(OmegaConf.merge(cfg, {"global_batch_size": 2}), ByteTokenizer())


@pytest.mark.learning
@pytest.mark.parametrize("seed", [1234, 7, 11])
def test_kto_separates_desirable_from_undesirable(tmp_path, sft_nemo, seed):
    """On the built-in data, 60 KTO steps from the SFT model: the implied reward of held-out desirable
    responses ends clearly above that of undesirable ones (measured ~0.8 at beta 0.1), for each seed."""
    from nemo_aligner.data.nlp.builtin_task import BuiltinTask

    data = BuiltinTask(seed=0).write_all(str(tmp_path / "data"), n_train=1000, n_val=128)
    log_dir = tmp_path / "kto"
    proc = run_script("train_gpt_kto.py", [
        f"pretrained_checkpoint.restore_from_path={sft_nemo}",
        f"++model.data.data_prefix={{train: [{data['kto_train']}], validation: [{data['kto_val']}]}}",
        f"exp_manager.explicit_log_dir={log_dir}", "trainer.kto.max_steps=60", "trainer.kto.max_epochs=100",
        "trainer.kto.val_check_interval=30", *tiny_optim(2e-4, 1e-5, 5), "model.kto.ref_policy_kl_penalty=0.1",
        f"model.seed={seed}"])
    metrics = read_metrics(log_dir)
    val = [r for r in metrics if "val/reward_margin" in r]
    first_train = next(r for r in metrics if "train/reward_margin" in r)
    assert first_train["train/reward_margin"] == pytest.approx(0.0, abs=1e-4)  # policy == reference at step 1
    assert val[-1]["step"] == 60 and val[-1]["val/samples"] == 128
    assert val[-1]["val/reward_margin"] > 0.5 and val[-1]["val/reward_margin"] > val[0]["val/reward_margin"], val
    assert val[-1]["val/rewards_undesirable_mean"] < 0, val
    assert "KTO finished: 60 steps" in proc.stdout
