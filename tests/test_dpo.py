"""DPO family: each loss against a hand computation, the pair dataset's masks, and DPO on the
built-in preference data (held-out preference accuracy, margin, reference untouched)."""

import math

import pytest
import torch

from conftest import read_metrics, run_script, tiny_optim
from nemo_aligner.data.nlp.dpo_dataset import DPOPairDataset, collate_dpo, render_chat_prompt
from nemo_aligner.utils.errors import DataError
from nemo_aligner.utils.preference_losses import preference_loss, preference_objective, sequence_logps
from nemo_aligner.utils.tokenizers import ByteTokenizer

C = torch.tensor([1.0, -0.5, 2.0])
R = torch.tensor([0.5, 0.5, -1.0])


def sig(x):
    return 1 / (1 + math.exp(-x))


def test_dpo_is_minus_log_sigmoid_of_beta_margin():
    got = preference_loss("dpo", C, R, beta=0.2)
    assert got.tolist() == pytest.approx([-math.log(sig(0.2 * (c - r))) for c, r in zip(C.tolist(), R.tolist())])


def test_ipo_squared_form():
    got = preference_loss("ipo", C, R, beta=0.5)
    assert got.tolist() == pytest.approx([(c - r - 1.0) ** 2 for c, r in zip(C.tolist(), R.tolist())])


def test_rpo_losses_use_ground_truth_rewards():
    gc, gr = torch.tensor([2.0, 1.0, 0.0]), torch.tensor([0.0, 1.0, 1.0])
    sq = preference_loss("rpo_sq", C, R, 0.2, gc, gr, gt_reward_scale=0.5)
    assert sq.tolist() == pytest.approx([(0.2 * (c - r) - 0.5 * (a - b)) ** 2
                                         for c, r, a, b in zip(C.tolist(), R.tolist(), gc.tolist(), gr.tolist())])
    for kind in ("rpo_bwd_kl", "rpo_fwd_kl"):
        got = preference_loss(kind, C, R, 0.2, gc, gr, 0.5)
        for i, (c, r, a, b) in enumerate(zip(C.tolist(), R.tolist(), gc.tolist(), gr.tolist())):
            p = [sig(0.2 * (c - r)), sig(-0.2 * (c - r))]  # policy's Bernoulli
            q = [sig(0.5 * (a - b)), sig(-0.5 * (a - b))]  # ground truth's
            kl = sum(qi * math.log(qi / pi) for qi, pi in zip(q, p)) if kind == "rpo_bwd_kl" else \
                sum(pi * math.log(pi / qi) for qi, pi in zip(q, p))
            assert got[i].item() == pytest.approx(kl, abs=1e-6), (kind, i)
    with pytest.raises(ValueError, match="needs ground-truth rewards"):
        preference_loss("rpo_sq", C, R, 0.2)


@pytest.mark.parametrize("kind, pref_w, sft_w", [("dpo", 1.0, 0.3), ("ipo", 0.5, 2.0), ("dpo", 0.0, 1.0)])
def test_objective_adds_the_nll_of_the_chosen_responses(kind, pref_w, sft_w):
    """``(pref_w * sum w * loss + sft_w * sum w * (-log pi(chosen))) / sum w``, padding pairs (w = 0) out;
    the SFT term reads the chosen responses' log-probs, never the rejected ones'."""
    chosen_logps = torch.tensor([-3.0, -1.5, -9.0, -4.0])
    weight = torch.tensor([1.0, 1.0, 1.0, 0.0])
    c, r = torch.tensor([1.0, -0.5, 2.0, 50.0]), torch.tensor([0.5, 0.5, -1.0, -50.0])
    loss, sums = preference_objective(kind, c, r, chosen_logps, weight, 0.2, pref_w, sft_w)
    per_pair = preference_loss(kind, c, r, 0.2).tolist()[:3]
    assert sums["preference_loss_sum"].item() == pytest.approx(sum(per_pair))
    assert sums["sft_loss_sum"].item() == pytest.approx(3.0 + 1.5 + 9.0)
    assert loss.item() == pytest.approx((pref_w * sum(per_pair) + sft_w * 13.5) / 3)
    assert sums["correct"].item() == 2.0 and sums["pairs"].item() == 3.0
    assert sums["rewards_chosen_sum"].item() == pytest.approx(0.2 * 2.5)
    assert sums["rewards_rejected_sum"].item() == pytest.approx(0.2 * 0.0)


def test_sequence_logps_sum_and_mean():
    logps = torch.tensor([[-1.0, -2.0, -3.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0]])
    assert sequence_logps(logps, mask).item() == -5.0 and sequence_logps(logps, mask, True).item() == -2.5


def test_pair_dataset_masks_responses_only():
    tok = ByteTokenizer()
    records = [{"prompt": "reverse ab = ", "chosen_response": "ba", "rejected_response": "abc", "__line__": 1}]
    ds = DPOPairDataset(None, tok, 32, records=records)
    batch = collate_dpo([ds[0]], tok.eos_id, 32)
    for side, text in (("chosen", "ba"), ("rejected", "abc")):
        tokens, mask = batch[side][0], batch[f"{side}_mask"][0]
        targets = tokens[1:][mask.bool()].tolist()
        assert targets == tok.text_to_ids(text) + [tok.eos_id], side
    assert batch["chosen"].shape == batch["rejected"].shape
    assert batch["chosen_rewards"].tolist() == [1.0] and batch["rejected_rewards"].tolist() == [0.0]
    chat = render_chat_prompt([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}], "f:1")
    assert chat == "\x00System\nbe brief\n\x11User\nhi\n\x11Assistant\n"
    with pytest.raises(DataError, match=r"f\.jsonl:3: missing field 'rejected_response'"):
        DPOPairDataset(None, tok, 32, records=[{"prompt": "x", "chosen_response": "y", "__line__": 3,
                                                 "__file__": "f.jsonl"}])


def test_append_eod_false_scores_responses_without_eos():
    tok = ByteTokenizer()
    records = [{"prompt": "reverse ab = ", "chosen_response": "ba", "rejected_response": "abc", "__line__": 1}]
    ds = DPOPairDataset(None, tok, 32, records=records, add_eos=False)
    batch = collate_dpo([ds[0]], tok.eos_id, 32)
    assert batch["chosen"][0][1:][batch["chosen_mask"][0].bool()].tolist() == tok.text_to_ids("ba")
    from nemo_aligner.data.nlp.kto_dataset import KTODataset, collate_kto

    kto = KTODataset(None, tok, 32, records=[{"prompt": "p ", "response": "ok", "preference": "chosen", "__line__": 1},
                                             {"prompt": "q ", "response": "no", "preference": "rejected",
                                              "__line__": 2}], add_eos=False)
    batch = collate_kto([kto[0], kto[1]], tok, 32)
    assert batch["tokens"][0][1:][batch["mask"][0].bool()].tolist() == tok.text_to_ids("ok")
    assert batch["kl_tokens"][0][1:][batch["kl_mask"][0].bool()].tolist() == tok.text_to_ids("no")


def test_aligner_chat_format_pairs():
    """NeMo-Aligner's chat DPO records: a list prompt and assistant-message responses. As its
    DPOModelDataset renders them, the prompt ends after the last user turn and each scored response is
    ``\x11Assistant\n{content}\n\x11`` (here followed by EOS)."""
    tok = ByteTokenizer()
    record = {"prompt": [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}],
              "chosen_response": {"role": "assistant", "content": "A"},
              "rejected_response": [{"role": "assistant", "content": "B"}], "__line__": 1}
    ds = DPOPairDataset(None, tok, 64, records=[record])
    batch = collate_dpo([ds[0]], tok.eos_id, 64)
    for side, content in (("chosen", "A"), ("rejected", "B")):
        tokens, mask = batch[side][0], batch[f"{side}_mask"][0]
        assert tok.ids_to_text(tokens[: int(mask.sum()) + ds[0][f"{side}_prompt"]].tolist()).startswith(
            "\x00System\nS\n\x11User\nQ\n")
        assert tokens[1:][mask.bool()].tolist() == tok.text_to_ids(f"\x11Assistant\n{content}\n\x11") + [tok.eos_id]
    with pytest.raises(DataError, match=r"x\.jsonl:2: chosen_response and rejected_response must both be strings"):
        DPOPairDataset(None, tok, 64, records=[dict(record, rejected_response="B", __line__=2, __file__="x.jsonl")])
    with pytest.raises(DataError, match=r"x\.jsonl:2: field 'chosen_response' must be a string or an assistant"):
        DPOPairDataset(None, tok, 64, records=[dict(record, chosen_response={"role": "user", "content": "A"},
                                                    __line__=2, __file__="x.jsonl")])


@pytest.mark.learning
@pytest.mark.parametrize("seed", [1234, 7, 11])
def test_dpo_learns_preferences_and_keeps_the_reference(tmp_path, sft_nemo, seed):
    """On the built-in pairs, DPO from the SFT model reaches >= 90% held-out preference accuracy with
    a clearly positive reward margin (implied rewards beta * log-ratio), for three seeds (measured at
    step 60: accuracy 0.945 / 0.953 / 0.922, margin 1.64 / 1.53 / 1.64)."""
    from nemo_aligner.data.nlp.builtin_task import BuiltinTask

    data = BuiltinTask(seed=0).write_all(str(tmp_path / "data"), n_train=1000, n_val=128)
    log_dir = tmp_path / "dpo"
    proc = run_script("train_gpt_dpo.py", [
        f"pretrained_checkpoint.restore_from_path={sft_nemo}",
        f"++model.data.data_prefix={{train: [{data['dpo_train']}], validation: [{data['dpo_val']}]}}",
        f"exp_manager.explicit_log_dir={log_dir}", "trainer.dpo.max_steps=60", "trainer.dpo.max_epochs=100",
        "trainer.dpo.val_check_interval=30", "model.dpo.ref_policy_kl_penalty=0.2",
        *tiny_optim(2e-4, 1e-5, 5), f"model.seed={seed}"])
    val = [r for r in read_metrics(log_dir) if "val/accuracy" in r]
    print(f"DPO seed {seed}: " + ", ".join(f"step {r['step']}: accuracy {r['val/accuracy']:.3f}, margin "
                                           f"{r['val/reward_margin']:.3f}" for r in val))
    first_train = next(r for r in read_metrics(log_dir) if "train/accuracy" in r)
    assert val[-1]["step"] == 60
    assert val[-1]["val/accuracy"] >= 0.9, val
    assert val[-1]["val/reward_margin"] > 1.0 and val[-1]["val/reward_margin"] > val[0]["val/reward_margin"], val
    assert first_train["train/reward_margin"] == pytest.approx(0.0, abs=1e-4)  # policy == reference at step 1
    assert "preference accuracy" in proc.stdout


def test_reference_weights_stay_while_the_policy_trains(mcore_single):
    from omegaconf import OmegaConf

    from conftest import TINY_ARCH
    from nemo_aligner.models.nlp.gpt.megatron_gpt_dpo_model import MegatronGPTDPOModel

    torch.manual_seed(0)
    cfg = OmegaConf.create(dict(TINY_ARCH, micro_batch_size=2, global_batch_size=4, encoder_seq_length=32,
                                dpo={"ref_policy_kl_penalty": 0.1},
                                optim={"name": "fused_adam", "lr": 1e-2, "sched": {"name": "Constant"}}))
    tok = ByteTokenizer()
    model = MegatronGPTDPOModel(cfg, tok)
    model.setup_optimization(max_steps=10)
    model.snapshot_reference_policy()
    start = {k: v.clone() for k, v in model.module.state_dict().items() if isinstance(v, torch.Tensor)}
    records = [{"prompt": f"reverse {w} = ", "chosen_response": w[::-1], "rejected_response": w, "__line__": i}
               for i, w in enumerate(["abc", "bcd", "cde", "def"])]
    ds = DPOPairDataset(None, tok, 32, records=records)
    batch = collate_dpo([ds[i] for i in range(4)], tok.eos_id, 32)
    ref_before = model.reference_logps(batch)
    for _ in range(3):
        model.prepare_for_training_step()
        loss, metrics = model.get_loss_and_metrics(batch, forward_only=False)
        model.optimizer.step()
    ref_after = model.reference_logps(batch)
    assert torch.equal(ref_before[0], ref_after[0]) and torch.equal(ref_before[1], ref_after[1])
    for k, v in model.ref_state.items():  # a CPU copy while the model is on a GPU
        assert torch.equal(v, start[k].to(v.device)), k
    moved = [k for k, v in model.module.state_dict().items() if isinstance(v, torch.Tensor) and not torch.equal(v, start[k])]
    assert moved  # the policy itself did train
    assert metrics["reward_margin"] > 0 and metrics["accuracy"] == 1.0


@pytest.mark.stack
@pytest.mark.parametrize("average", [False, True])
def test_logged_metrics_equal_an_independent_computation(mcore_single, average):
    """The DPO model's loss and logged metrics (preference loss, SFT loss, rewards, accuracy) with an SFT
    term and a policy moved away from its reference, against log-probs from megatron-core's own forward
    of the reference and of the policy."""
    from omegaconf import OmegaConf

    from conftest import TINY_ARCH, forward_logits
    from nemo_aligner.models.nlp.gpt.megatron_gpt_dpo_model import MegatronGPTDPOModel

    torch.manual_seed(1)
    beta, pref_w, sft_w = 0.3, 0.7, 0.4
    cfg = OmegaConf.create(dict(TINY_ARCH, micro_batch_size=2, global_batch_size=4, encoder_seq_length=32,
                                dpo={"ref_policy_kl_penalty": beta, "preference_loss_weight": pref_w,
                                     "sft_loss_weight": sft_w, "preference_average_log_probs": average,
                                     "sft_average_log_probs": average},
                                optim={"name": "fused_adam", "lr": 1e-2, "sched": {"name": "Constant"}}))
    tok = ByteTokenizer()
    model = MegatronGPTDPOModel(cfg, tok)
    model.setup_optimization(max_steps=10)
    model.snapshot_reference_policy()
    records = [{"prompt": f"reverse {w} = ", "chosen_response": w[::-1], "rejected_response": w + "x" * i, "__line__": i}
               for i, w in enumerate(["abc", "bcdef", "cd", "defg"])]
    ds = DPOPairDataset(None, tok, 32, records=records)
    batch = collate_dpo([ds[i] for i in range(4)], tok.eos_id, 32)

    def logps(tokens):
        logits = forward_logits(model, tokens).float()
        return torch.log_softmax(logits, -1)[:, :-1].gather(-1, tokens[:, 1:].unsqueeze(-1)).squeeze(-1)

    ref = {side: logps(batch[side]) for side in ("chosen", "rejected")}
    with torch.no_grad():
        for p in model.module.parameters():
            p.add_(0.02 * torch.randn_like(p))
    pol = {side: logps(batch[side]) for side in ("chosen", "rejected")}
    loss, metrics = model.get_loss_and_metrics(batch, forward_only=True)

    def seq(values, side):
        return sequence_logps(values, batch[f"{side}_mask"], average)

    c = seq(pol["chosen"] - ref["chosen"], "chosen")
    r = seq(pol["rejected"] - ref["rejected"], "rejected")
    pref = -torch.nn.functional.logsigmoid(beta * (c - r))
    sft = -seq(pol["chosen"], "chosen")
    assert (c - r).abs().min() > 1e-3  # the policy did move, in a way the reference does not cancel
    assert metrics["preference_loss"] == pytest.approx(pref.mean().item(), rel=1e-4)
    assert metrics["sft_loss"] == pytest.approx(sft.mean().item(), rel=1e-4)
    assert metrics["loss"] == pytest.approx(pref_w * pref.mean().item() + sft_w * sft.mean().item(), rel=1e-4)
    assert loss == pytest.approx(metrics["loss"], rel=1e-4)
    assert metrics["rewards_chosen_mean"] == pytest.approx(beta * c.mean().item(), abs=1e-5)
    assert metrics["rewards_rejected_mean"] == pytest.approx(beta * r.mean().item(), abs=1e-5)
    assert metrics["accuracy"] == pytest.approx((c > r).float().mean().item())


@pytest.mark.parametrize("algorithm,parallel", [
    ("dpo", "model.tensor_model_parallel_size=2"), ("dpo", "model.pipeline_model_parallel_size=2"),
    ("kto", "model.pipeline_model_parallel_size=2")], ids=["dpo-tp2", "dpo-pp2", "kto-pp2"])
def test_two_processes_match_one(tmp_path, builtin_data, quick_sft, algorithm, parallel):
    """DPO and KTO (their paired/mismatched micro-batches, the reference policy swapped in, the KL
    estimate) at TP=2 or PP=2 give the losses of one process, step for step."""
    from conftest import train_losses, val_losses

    def overrides(log_dir):
        return [f"pretrained_checkpoint.restore_from_path={quick_sft}",
                f"++model.data.data_prefix={{train: [{builtin_data[algorithm + '_train']}], "
                f"validation: [{builtin_data[algorithm + '_val']}]}}",
                f"exp_manager.explicit_log_dir={log_dir}", f"trainer.{algorithm}.max_steps=3",
                f"trainer.{algorithm}.max_epochs=100", f"trainer.{algorithm}.val_check_interval=3",
                "model.global_batch_size=8", "model.micro_batch_size=2", "model.optim.lr=1e-3",
                "model.optim.sched.warmup_steps=0", "exp_manager.create_checkpoint_callback=False",
                f"trainer.{algorithm}.limit_val_batches=2"]

    script = f"train_gpt_{algorithm}.py"
    run_script(script, overrides(tmp_path / "one"), like_nproc=2)  # the device kind of the two-process run
    run_script(script, overrides(tmp_path / "two") + ["trainer.devices=2", parallel], nproc=2)
    a, b = train_losses(tmp_path / "one"), train_losses(tmp_path / "two")
    assert sorted(a) == [1, 2, 3] and a[3] != a[1]  # it trains
    # rel 5e-5: TP=2 sums in another order, and Adam's first steps magnify the rounding of near-zero
    # gradients (2.2e-5 seen at step 2 on a 16-core machine with other MKL kernels)
    for step in (1, 2, 3):
        assert b[step] == pytest.approx(a[step], rel=5e-5, abs=1e-6), step
    assert val_losses(tmp_path / "two")[3] == pytest.approx(val_losses(tmp_path / "one")[3], rel=5e-5, abs=1e-6)
