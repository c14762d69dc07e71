"""Scripts with a model's experts split over two ranks (model.expert_model_parallel_size=2): ranks that
generate for their own prompts do so in rounds of the expert group (expert_lockstep), and every role
gives what one process holding every expert, or two data-parallel ranks each holding every expert,
give."""

import json
import os

import pytest
import torch

from conftest import SCRIPTS, WORKERS, read_metrics, run_python, run_script, upcycle_to_experts


@pytest.fixture(scope="module")
def moe_nemo(mcore_single, quick_sft, tmp_path_factory):
    return upcycle_to_experts(quick_sft, str(tmp_path_factory.mktemp("moe") / "moe.nemo"))


def test_generating_ranks_match_one_process_holding_every_expert(moe_nemo, tmp_path):
    """Two ranks, each with 2 of the 4 experts, run different numbers of generation calls (greedy and
    sampled) whose rows stop at different steps, then the initial-policy log-probs (a weight swap)
    and the current ones: the tokens are those of one process holding every expert, the log-probs
    equal. The initial policy's experts differ from the current one's, so a rank that swapped while
    its peer still generated would change the peer's tokens. SPIN's model, which swaps the reference
    policy in and out around each generation call, likewise. Then the ranks ask for log-probs of
    4 rows in micro-batches of 1 and 3 rows in one micro-batch: both stop with the same message
    instead of waiting on each other's MoE layers."""
    worker = os.path.join(WORKERS, "expert_lockstep_worker.py")
    run_python(worker, ["--nemo", moe_nemo, "--out", tmp_path / "one.json"], like_nproc=2)
    run_python(worker, ["--nemo", moe_nemo, "--ep", "2", "--roles", "actor,spin,uneven", "--out", tmp_path / "two.json"],
               nproc=2)
    one, two = (json.loads((tmp_path / name).read_text()) for name in ("one.json", "two.json"))
    lengths = [[len(row) for row in part["tokens"]] for part in one["actor"]]
    assert len(set(lengths[0])) > 1 and len(lengths[0]) != len(lengths[1])  # the ranks' work differs
    for rank in range(2):
        actor_one, actor_two = one["actor"][rank], two["actor"][rank]
        assert actor_two["tokens"] == actor_one["tokens"], rank
        for key in ("init_logprobs", "logprobs"):
            torch.testing.assert_close(torch.tensor(actor_two[key]), torch.tensor(actor_one[key]), rtol=0, atol=1e-5)
        assert (torch.tensor(actor_one["init_logprobs"]) - torch.tensor(actor_one["logprobs"])).abs().max() > 0.1
    assert [len(row) for row in one["spin"][0]["tokens"]] != [len(row) for row in one["spin"][1]["tokens"]]
    assert two["spin"] == one["spin"]
    for name in ("two.json", "two.json.1"):
        assert json.loads((tmp_path / name).read_text())["uneven"] == (
            "the ranks of model.expert_model_parallel_size=2 hold from 1 to 4 micro-batches in one forward/backward "
            "pass; their MoE layers need the same number on every rank")


def grpo(model, data, log_dir, *extra, nproc=2, check=True, devices=2):
    return run_script("train_gpt_grpo.py", [
        f"pretrained_checkpoint.restore_from_path={model}",
        f"++model.data.data_prefix={{train: [{data['prompts_train']}], validation: [{data['prompts_val']}]}}",
        "reward_fn=nemo_aligner.data.nlp.builtin_task:reward", f"exp_manager.explicit_log_dir={log_dir}",
        "trainer.grpo.max_steps=2", "trainer.grpo.max_epochs=100", "trainer.grpo.val_check_interval=2",
        "model.grpo.num_rollout_samples=8", "model.grpo.num_responses_per_prompt=4",
        "model.grpo.rollout_micro_batch_size=4", "model.grpo.num_val_samples=10", "model.grpo.val_rollout_micro_batch_size=4",
        "model.global_batch_size=32", "model.micro_batch_size=8", "model.grpo.length_params.max_length=9",
        "model.optim.lr=5e-5", f"trainer.devices={devices}", *extra], nproc=nproc, check=check)


def assert_same_metrics(a, b, keys):
    for key in keys:
        x = [(r["step"], r[key]) for r in a if key in r]
        y = [(r["step"], r[key]) for r in b if key in r]
        assert x and [s for s, _ in y] == [s for s, _ in x], key
        assert [v for _, v in y] == pytest.approx([v for _, v in x], rel=1e-5, abs=1e-6), key


def test_grpo_with_experts_split_trains_like_data_parallel(moe_nemo, builtin_data, tmp_path):
    """GRPO at data parallel 2 with each rank holding all four experts, against 4 ranks as two pipeline
    stages of one layer, each stage's experts split over its two data-parallel ranks (an expert
    group per stage, its ranks generating for their own prompts in rounds while the other stage's
    ranks wait on activations): the same responses, rewards, losses and validation scores;
    batch_iterator.use_flask, which talks over the data-parallel ranks between generation calls, is
    refused in one line."""
    keys = ("train/rewards", "train/actor_loss", "train/kl_loss", "train/response_length", "val/global_rewards")
    grpo(moe_nemo, builtin_data, tmp_path / "dp")
    proc = grpo(moe_nemo, builtin_data, tmp_path / "ppep", "++model.pipeline_model_parallel_size=2",
                "++model.expert_model_parallel_size=2", nproc=4, devices=4)
    assert "(experts split over 2 of them)" in proc.stdout + proc.stderr
    assert_same_metrics(read_metrics(tmp_path / "dp"), read_metrics(tmp_path / "ppep"), keys)
    proc = grpo(moe_nemo, builtin_data, tmp_path / "flask", "++model.expert_model_parallel_size=2",
                "trainer.grpo.batch_iterator.use_flask=True", nproc=1, check=False)  # the script starts its ranks
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert ("error: trainer.grpo.batch_iterator.use_flask=True is not supported with "
            "model.expert_model_parallel_size=2; set it to False") in proc.stderr


def test_generate_and_top_k_logits_scripts_with_experts_split(moe_nemo, builtin_data, tmp_path):
    """generate_gpt.py shares its prompt batches out over the data-parallel ranks (here 2, the experts split
    over them) and writes what one process writes, sampled responses included; compute_topk_logits.py
    (a partial last block: 5 samples over 2 ranks) writes one process's records."""
    topk_script = os.path.join(os.path.dirname(SCRIPTS), "synthetic_data_gen", "compute_topk_logits.py")
    for tag, nproc, extra in (("one", 1, []), ("ep2", 2, ["trainer.devices=2", "++model.expert_model_parallel_size=2"])):
        run_script("generate_gpt.py", [
            f"gpt_model_file={moe_nemo}", f"prompts_file={builtin_data['prompts_val']}",
            f"output_file={tmp_path / tag}.jsonl", "inference.greedy=False", "inference.seed=3",
            "inference.tokens_to_generate=9", "batch_size=8", *extra], nproc=nproc)
        run_python(topk_script, [f"pretrained_checkpoint.restore_from_path={moe_nemo}",
                                 f"data.data.file_path={builtin_data['sft_val']}", f"output_path={tmp_path / tag}.topk.jsonl",
                                 "top_k=4", "end_at_idx=20", "model.global_batch_size=16", "model.micro_batch_size=2",
                                 *extra], nproc=nproc)
    one, two = ((tmp_path / f"{tag}.jsonl").read_text().splitlines() for tag in ("one", "ep2"))
    assert len(one) == 64 and two == one
    one, two = ([json.loads(line) for line in (tmp_path / f"{tag}.topk.jsonl").read_text().splitlines()]
                for tag in ("one", "ep2"))
    assert [r["index"] for r in two] == [r["index"] for r in one] == list(range(21))
    for a, b in zip(one, two):
        assert b["topk_token_ids"] == a["topk_token_ids"]
        torch.testing.assert_close(torch.tensor(b["topk_logits"]), torch.tensor(a["topk_logits"]), rtol=0, atol=1e-4)

