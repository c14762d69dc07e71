"""REINFORCE / RLOO: the leave-one-out baseline against a hand computation, reward sources, and
the actor job raising the built-in task's reward with a Python reward function."""

import numpy as np
import pytest
import torch

from conftest import read_metrics, run_script, tiny_optim
from nemo_aligner.algorithms.reinforce import group_advantages
from nemo_aligner.utils.errors import AlignerError, ConfigError
from nemo_aligner.environments.reward_sources import FunctionRewardSource, load_reward_fn
from nemo_aligner.servers.clients import RemoteRewardSource
from nemo_aligner.utils.tokenizers import ByteTokenizer


def test_leave_one_out_baseline_excludes_the_sample_itself():
    rewards = torch.tensor([1.0, 0.0, 0.5, 2.0, 4.0, 3.0, 7.0])
    groups = torch.tensor([0, 0, 0, 1, 1, 1, 2])  # the last prompt has a single response
    got = group_advantages(rewards, groups, leave_one_out=True)
    expected = []
    for i, r in enumerate(rewards.tolist()):
        others = [rewards[j].item() for j in range(len(rewards)) if groups[j] == groups[i] and j != i]
        expected.append(r - sum(others) / len(others) if others else 0.0)
    assert got.tolist() == pytest.approx(expected)
    assert got[0].item() == pytest.approx(1.0 - 0.25)  # 1 - mean(0, 0.5)
    with_self = group_advantages(rewards, groups, leave_one_out=False)
    assert with_self[:3].tolist() == pytest.approx([0.5, -0.5, 0.0]) and with_self[6].item() == 0.0
    # RLOO's advantage is the group-mean one scaled by k / (k - 1)
    assert got[:6].tolist() == pytest.approx((with_self[:6] * 3 / 2).tolist())
    normalised = group_advantages(rewards, groups, leave_one_out=False, normalize_std=True)
    std = torch.tensor([1.0, 0.0, 0.5]).std(unbiased=False)
    assert normalised[:3].tolist() == pytest.approx((with_self[:3] / (std + 1e-6)).tolist())


@pytest.mark.parametrize("leave_one_out, normalize_std", [(True, True), (False, True), (True, False)])
def test_responses_cut_at_max_length_set_no_baseline(leave_one_out, normalize_std):
    """Rows without EOS are not trained on, so they count in no baseline, deviation or all-equal test
    (NeMo-Aligner's valid mask): each advantage equals the one computed on the ended rows alone."""
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 2.0, 0.0, 5.0, 3.0])
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    ended = torch.tensor([True, True, True, False, True, True, False, True])
    got = group_advantages(rewards, groups, leave_one_out, normalize_std, valid=ended)
    assert got[:4].tolist() == [0.0] * 4  # every ended row of group 0 scored 1: nothing to learn
    alone = group_advantages(rewards[ended][3:], groups[ended][3:], leave_one_out, normalize_std)
    assert got[[4, 5, 7]].tolist() == pytest.approx(alone.tolist()) and got[6].item() == 0.0
    unmasked = group_advantages(rewards, groups, leave_one_out, normalize_std)
    assert unmasked[0].item() != 0.0  # without the mask the cut row would drag group 0 off zero


@pytest.mark.parametrize("leave_one_out, normalize_std", [(True, True), (False, True), (True, False)])
def test_a_group_with_equal_rewards_gets_no_advantage(leave_one_out, normalize_std):
    """Equal rewards in a group (common early in GRPO, or from a collapsed policy): exactly 0 for
    each response. Computed in float32, the leave-one-out mean differs from the reward by rounding,
    which the standard deviation of 0 (+ eps) used to turn into advantages of up to ~0.12 x |reward|,
    all of one sign. A group that differs keeps its exact advantages."""
    for value, n in ((0.9, 4), (7.3, 8), (-15.8, 16), (-29.8, 4)):
        rewards = torch.cat([torch.full((n,), value), torch.tensor([1.0, 0.0, 0.5, 0.25])])
        groups = torch.cat([torch.zeros(n, dtype=torch.long), torch.ones(4, dtype=torch.long)])
        got = group_advantages(rewards, groups, leave_one_out, normalize_std)
        assert got.dtype == torch.float32
        assert got[:n].tolist() == [0.0] * n, (value, n, got[:n])
        other = rewards[n:].double()
        mine = torch.stack([other[i] - (other.sum() - other[i]) / 3 for i in range(4)]) if leave_one_out \
            else other - other.mean()
        if normalize_std:
            mine = mine / (other.std(unbiased=False) + 1e-6)
        assert got[n:].tolist() == pytest.approx(mine.tolist(), rel=1e-6)


def test_non_finite_rewards_are_refused_naming_the_response():
    tok = ByteTokenizer()
    prompt = tok.text_to_ids("reverse abc = ")
    tokens = np.array([prompt + tok.text_to_ids("cba") + [tok.eos_id]] * 2)
    lengths = np.array([len(prompt)] * 2), np.array([tokens.shape[1]] * 2)
    values = iter([0.5, float("nan")])
    with pytest.raises(ConfigError, match=r"reward_fn returned nan for the response 'cba' to the prompt "
                                          r"'reverse abc = '; rewards must be finite"):
        FunctionRewardSource(lambda p, r: next(values), tok).score(tokens, *lengths)

    from types import SimpleNamespace

    from nemo_aligner.environments.reward_sources import EnvironmentRewardSource

    env = SimpleNamespace(step=lambda conversations: SimpleNamespace(rewards=[1.0, float("inf")], done=[True, True]))
    with pytest.raises(ConfigError, match=r"environment\.step returned inf as the reward of conversation 1"):
        EnvironmentRewardSource(env, tok).score(tokens, *lengths)


def test_reward_sources():
    tok = ByteTokenizer()
    fn = load_reward_fn("nemo_aligner.data.nlp.builtin_task:reward")
    prompt, right, wrong = tok.text_to_ids("reverse abc = "), tok.text_to_ids("cba"), tok.text_to_ids("abc")
    rows = [prompt + right + [tok.eos_id], prompt + wrong + [tok.eos_id, tok.eos_id]]
    tokens = np.array([rows[0] + [tok.eos_id], rows[1]])
    future = FunctionRewardSource(fn, tok).score(tokens, np.array([len(prompt)] * 2), np.array([len(rows[0]), len(prompt) + 4]))
    assert future.result().tolist() == pytest.approx([1.0, 1 / 3])
    for spec, message in (("nope", "must be 'package.module:function'"),
                          ("no_such_module_x:f", "cannot import 'no_such_module_x'"),
                          ("nemo_aligner.data.nlp.builtin_task:missing", "has no function 'missing'")):
        with pytest.raises(ConfigError, match=message):
            load_reward_fn(spec)
    from omegaconf import OmegaConf

    from conftest import free_port

    port = free_port()
    cfg = OmegaConf.create({"reward_model": {"ip": "127.0.0.1", "port": port}, "timeout_s": 5})
    with pytest.raises(AlignerError, match=rf"127\.0\.0\.1:{port}.*remote_rm\.reward_model"):
        RemoteRewardSource(cfg, pad_id=tok.eos_id)


@pytest.mark.learning
@pytest.mark.parametrize("seed", [1234, 7, 11])
def test_rloo_raises_the_task_reward(tmp_path, weak_policy, seed):
    """From a partly trained SFT model (150 steps), 100 RLOO steps with the built-in task's reward
    function, for three seeds: the mean sampled reward of the last 20 steps is above the first 20's by
    more than 0.05 and greedy validation does not get worse. Measured over 8 trajectories (seeds 1234,
    7, 11, 42, 3; two decode GEMMs, whose rounding makes trajectories differ): sampled +0.065 to +0.075
    (~0.62 -> 0.69-0.70), greedy 0.748 -> 0.763-0.779. At lr 1e-4 the sampled reward rose more but
    greedy validation spread over 0.737-0.801 (one seed below the start)."""
    model, data = weak_policy
    log_dir = tmp_path / "rloo"
    proc = run_script("train_gpt_reinforce_actor.py", [
        f"pretrained_checkpoint.restore_from_path={model}",
        f"++model.data.data_prefix={{train: [{data['prompts_train']}], validation: [{data['prompts_val']}]}}",
        "reward_fn=nemo_aligner.data.nlp.builtin_task:reward", f"exp_manager.explicit_log_dir={log_dir}",
        "trainer.reinforce.max_steps=100", "trainer.reinforce.max_epochs=100", "trainer.reinforce.val_check_interval=100",
        "model.reinforce.num_rollout_samples=32", "model.reinforce.num_responses_per_prompt=4",
        "model.global_batch_size=64", "model.micro_batch_size=16", "model.reinforce.rollout_micro_batch_size=32",
        "model.reinforce.num_val_samples=64", "model.reinforce.length_params.max_length=9",
        *tiny_optim(5e-5, 5e-5, 0), "model.optim.sched.name=Constant", f"model.seed={seed}"])
    metrics = read_metrics(log_dir)
    rewards = [r["train/rewards"] for r in metrics if "train/rewards" in r]
    val = {r["step"]: r["val/global_rewards"] for r in metrics if "val/global_rewards" in r}
    assert len(rewards) == 100 and sorted(val) == [0, 100]
    first, last = np.mean(rewards[:20]), np.mean(rewards[-20:])
    print(f"RLOO seed {seed} mean sampled reward: first 20 steps {first:.3f}, last 20 steps {last:.3f}; "
          f"greedy validation {val}")
    assert last > first + 0.05, (first, last)
    assert val[100] >= val[0] - 0.01, val
    assert all(r["train/init_policy_kl"] >= 0 for r in metrics if "train/init_policy_kl" in r)
    assert "REINFORCE finished: 100 steps" in proc.stdout


def test_prompt_files_carry_their_other_fields_to_the_reward_function():
    """A jsonl prompt record's fields besides ``text`` travel with its responses: a reward function
    gets those its signature names (all of them with **kwargs), the others nothing extra."""
    import numpy as np

    from nemo_aligner.data.nlp.prompt_dataset import PromptDataset, collate_prompts

    tok = ByteTokenizer()
    records = [{"text": "reverse ab =", "answer": "ba", "level": 1, "__line__": 1},
               {"text": "sort cab =", "metadata": {"answer": "abc"}, "__line__": 2}]
    ds = PromptDataset(None, tok, 32, records=records)
    batch = collate_prompts([ds[0], ds[1], ds[-1]])
    assert batch["metadata"] == [{"answer": "ba", "level": 1}, {"answer": "abc"}]
    rows = [tok.text_to_ids("reverse ab =ba"), tok.text_to_ids("sort cab =abc")]
    tokens = np.full((2, 16), tok.eos_id)
    for i, r in enumerate(rows):
        tokens[i, : len(r)] = r
    prompt_lengths, lengths = np.array([12, 10]), np.array([len(r) for r in rows])
    got = []
    named = FunctionRewardSource(lambda p, r, answer: got.append(answer) or float(r == answer), tok)
    assert named.score(tokens, prompt_lengths, lengths, batch["metadata"]).result().tolist() == [1.0, 1.0]
    every = FunctionRewardSource(lambda p, r, **fields: got.append(fields) or 0.0, tok)
    every.score(tokens, prompt_lengths, lengths, batch["metadata"])
    plain = FunctionRewardSource(lambda p, r: 0.5, tok)
    assert plain.score(tokens, prompt_lengths, lengths, batch["metadata"]).result().tolist() == [0.5, 0.5]
    assert got == ["ba", "abc", {"answer": "ba", "level": 1}, {"answer": "abc"}]


def test_api_prompt_records_carry_the_same_metadata_as_prompt_files():
    """The Python API's prompt records reach reward functions with the fields a prompt file's record
    would give (one rule, record_metadata), including a record whose only other field is ``metadata``."""
    from nemo_aligner.data.nlp.prompt_dataset import PromptDataset, record_metadata
    from nemo_aligner.trainers.datasets import prompt_records

    users = [{"prompt": "reverse ab =", "answer": "ba", "level": 1}, {"question": "sort cab =", "metadata": {"answer": "abc"}},
             "x =", {"prompt": "y =", "text": "a reference called text"}]
    written = prompt_records(users)  # what the API writes to its prompt file
    ds = PromptDataset(None, ByteTokenizer(), 32, records=written)
    expected = [record_metadata(u, k) for u, k in zip(users[:2], ("prompt", "question"))] + [{}, {"text": "a reference called text"}]
    assert [ds[i]["metadata"] for i in range(len(users))] == expected
    assert expected[1] == {"answer": "abc"}
