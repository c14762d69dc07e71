"""GRPO: the k3 KL estimator in the loss, group-normalised advantages, and the Hydra script."""

import math

import pytest
import torch

from conftest import read_metrics, run_script, stub_trainer
from nemo_aligner.algorithms.reinforce import group_advantages
from nemo_aligner.utils.ppo_utils import k3_kl


def test_k3_kl_by_hand_and_its_properties():
    logp, ref = torch.tensor([-1.0, -2.0, -0.5]), torch.tensor([-1.5, -1.0, -0.5])
    expected = [math.exp(r - l) - (r - l) - 1 for l, r in zip(logp.tolist(), ref.tolist())]
    assert k3_kl(logp, ref).tolist() == pytest.approx(expected)
    assert (k3_kl(torch.randn(100), torch.randn(100)) >= 0).all() and k3_kl(logp, logp).abs().max() == 0
    # unbiased: E_{x~p}[k3] = KL(p || q) for categorical p, q
    p = torch.tensor([0.7, 0.2, 0.1])
    q = torch.tensor([0.4, 0.4, 0.2])
    exact = float((p * (p / q).log()).sum())
    assert float((p * k3_kl(p.log(), q.log())).sum()) == pytest.approx(exact, rel=1e-6)


def test_group_normalised_advantages():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 0.3, 0.3])
    groups = torch.tensor([0, 0, 0, 0, 1, 1])
    adv = group_advantages(rewards, groups, leave_one_out=False, normalize_std=True)
    mean, std = 0.25, math.sqrt(0.1875)
    assert adv[:4].tolist() == pytest.approx([(r - mean) / (std + 1e-6) for r in [1.0, 0.0, 0.0, 0.0]])
    assert adv[4:].tolist() == [0.0, 0.0]  # equal rewards: no signal, not a division by zero


@pytest.mark.stack
def test_grpo_script_runs_with_kl_in_the_loss(tmp_path, quick_sft, builtin_data):
    log_dir = tmp_path / "grpo"
    proc = run_script("train_gpt_grpo.py", [
        f"pretrained_checkpoint.restore_from_path={quick_sft}",
        f"++model.data.data_prefix={{train: [{builtin_data['prompts_train']}], validation: [{builtin_data['prompts_val']}]}}",
        "reward_fn=nemo_aligner.data.nlp.builtin_task:reward", f"exp_manager.explicit_log_dir={log_dir}",
        "trainer.grpo.max_steps=3", "trainer.grpo.max_epochs=100", "model.grpo.num_rollout_samples=8",
        "model.grpo.num_responses_per_prompt=4", "model.global_batch_size=32", "model.micro_batch_size=8",
        "model.grpo.num_val_samples=16", "model.grpo.length_params.max_length=9", "model.optim.lr=5e-5"])
    train = [r for r in read_metrics(log_dir) if "train/rewards" in r]
    assert [r["step"] for r in train] == [1, 2, 3]
    assert train[0]["train/kl_loss"] == pytest.approx(0.0, abs=1e-6)  # the policy starts at the reference
    assert train[-1]["train/kl_loss"] > 0
    for key in ("train/rewards", "train/advantage_abs_mean", "train/clip_fraction", "train/actor_loss"):
        assert all(math.isfinite(r[key]) for r in train), key
    assert "GRPO finished: 3 steps" in proc.stdout


class ScriptedPolicy:
    """A stand-in policy for the episode loop: answers each row from ``script`` (turn -> text) and ends it
    with EOS, except rows listed in ``unended`` (cut at the length limit); records its prompts."""

    def __init__(self, script, unended=()):
        from types import SimpleNamespace

        from nemo_aligner.utils.tokenizers import ByteTokenizer

        self.tokenizer, self.script, self.unended = ByteTokenizer(), script, set(unended)
        self.cfg = SimpleNamespace(encoder_seq_length=128)
        self.seen = []

    def infer(self, prompts, seed=None, sampling=None):
        from nemo_aligner.models.nlp.gpt.generation import GenerationOutput

        tok, rows, ends = self.tokenizer, [], []
        for prompt in prompts:
            text = self.tokenizer.ids_to_text(prompt)
            self.seen.append(text)
            row = int(text.split("#")[1][0])  # prompts are "#<row> ..."
            turn = text.count(" then: ")
            ended = (row, turn) not in self.unended
            rows.append(list(prompt) + tok.text_to_ids(self.script[row][turn]) + ([tok.eos_id] if ended else []))
            ends.append(ended)
        width = max(len(r) for r in rows)
        tokens = torch.full((len(rows), width), tok.eos_id, dtype=torch.long)
        for i, r in enumerate(rows):
            tokens[i, : len(r)] = torch.tensor(r)
        return GenerationOutput(tokens, torch.tensor([len(p) for p in prompts]), torch.tensor([len(r) for r in rows]),
                                torch.tensor(ends))


class SecondTurnDecides:
    """Turn 1: reward ``first_turn_pays`` x the first answer's length (0 by default) and the observation
    " then: "; turn 2: reward = the second answer's length / 10."""

    def __init__(self, first_turn_pays=0.0):
        self.calls = []
        self.first_turn_pays = first_turn_pays

    def step(self, conversations, metadata=None):
        from nemo_aligner.environments import EnvironmentReturn

        self.calls.append([list(c) for c in conversations])
        rewards, done, observations = [], [], []
        for c in conversations:
            if sum(m["role"] == "assistant" for m in c) == 1:
                rewards.append(self.first_turn_pays * len(c[-1]["content"]))
                done.append(False), observations.append({"role": "user", "content": " then: "})
            else:
                rewards.append(len(c[-1]["content"]) / 10), done.append(True), observations.append(None)
        return EnvironmentReturn(rewards, done, observations)


def test_every_turn_of_a_two_step_environment_counts(mcore_single):
    """Episodes of a two-step environment whose reward only the second answer decides: the rollout row is
    prompt, answer 1, observation, answer 2; its reward is the second turn's; the loss mask covers both
    answers and not the observation; a first answer that did not end stops its episode; the advantages
    follow the second answers."""
    from nemo_aligner.algorithms.multi_turn import EpisodeStats, play_episodes
    from nemo_aligner.algorithms.ppo import Timer
    from nemo_aligner.algorithms.reinforce import ReinforceTrainer
    from nemo_aligner.environments.reward_sources import EnvironmentRewardSource

    script = {0: ["ab", "xyz"], 1: ["ab", "x"], 2: ["ab", "wxyz"], 3: ["abc", "never asked"]}
    policy = ScriptedPolicy(script, unended={(3, 0)})
    env = SecondTurnDecides()
    tok = policy.tokenizer
    prompts = [tok.text_to_ids(f"#{i} q =") for i in range(4)]
    batch = play_episodes(policy, EnvironmentRewardSource(env, tok), prompts, None, micro_batch_size=3, seed=0,
                          sampling=None, max_turns=3, timer=Timer(), stats=EpisodeStats(), key="model.grpo.max_rollout_turns")
    rewards = batch.pop("_futures")[0].result()
    assert rewards.tolist() == pytest.approx([0.3, 0.1, 0.4, 0.0])
    assert batch["turns"].tolist() == [2, 2, 2, 1] and batch["is_end"].tolist() == [True, True, True, False]
    assert len(env.calls) == 2 and len(env.calls[1]) == 3  # row 3 did not end its answer: no second turn
    assert env.calls[1][0] == [{"role": "user", "content": "#0 q ="}, {"role": "assistant", "content": "ab"},
                               {"role": "user", "content": " then: "}, {"role": "assistant", "content": "xyz"}]
    eos = tok.ids_to_text([tok.eos_id])
    row0 = tok.ids_to_text(batch["tokens"][0, : int(batch["response_lengths"][0])].tolist())
    assert row0 == f"#0 q =ab{eos} then: xyz{eos}"
    # the mask: log-prob positions predicting "ab<eos>" and "xyz<eos>", not " then: "
    p = len(prompts[0])
    policy_tokens = [t + 1 for t in range(batch["policy_mask"].shape[1]) if batch["policy_mask"][0, t]]
    assert policy_tokens == [p, p + 1, p + 2] + [p + 3 + 7 + k for k in range(4)]
    batch.update(rewards=torch.tensor(rewards), logprobs=None, init_logprobs=None,
                 group_ids=torch.tensor([0, 0, 0, 0]))
    trainer = stub_trainer(ReinforceTrainer, kl_penalty=0.0, use_absolute_kl=True, leave_one_out=True,
                           normalize_rewards=False, dp_group=None)
    metrics = trainer.compute_advantages(batch)
    assert torch.equal(batch["mask"][0], batch["policy_mask"][0]) and batch["mask"][3].sum() == 3
    ended = [0.3, 0.1, 0.4]  # row 3 (cut) is in no baseline
    for row in range(3):
        expected = ended[row] - (sum(ended) - ended[row]) / 2
        trained = batch["advantages"][row][batch["mask"][row].bool()].tolist()
        assert trained == pytest.approx([expected] * int(batch["mask"][row].sum()))
    assert metrics["turns"] == pytest.approx(7 / 4)


def test_an_episodes_reward_is_the_sum_of_its_turns():
    """Where both turns pay, the episode's reward is turn 1's plus turn 2's; an episode stopped after
    turn 1 keeps turn 1's reward."""
    from nemo_aligner.algorithms.multi_turn import EpisodeStats, play_episodes
    from nemo_aligner.algorithms.ppo import Timer
    from nemo_aligner.environments.reward_sources import EnvironmentRewardSource

    policy = ScriptedPolicy({0: ["ab", "xyz"], 1: ["abcd", "x"], 2: ["abc", "never asked"]}, unended={(2, 0)})
    tok = policy.tokenizer
    prompts = [tok.text_to_ids(f"#{i} q =") for i in range(3)]
    batch = play_episodes(policy, EnvironmentRewardSource(SecondTurnDecides(first_turn_pays=0.01), tok), prompts, None,
                          micro_batch_size=3, seed=0, sampling=None, max_turns=2, timer=Timer(), stats=EpisodeStats(),
                          key="model.grpo.max_rollout_turns")
    rewards = batch.pop("_futures")[0].result()
    assert rewards.tolist() == pytest.approx([0.02 + 0.3, 0.04 + 0.1, 0.03])


def test_max_rollout_turns_needs_an_environment_and_cuts_long_episodes(mcore_single, caplog):
    from nemo_aligner.algorithms.multi_turn import EpisodeStats, play_episodes
    from nemo_aligner.algorithms.ppo import Timer
    from nemo_aligner.algorithms.reinforce import check_rollout_turns
    from nemo_aligner.environments.reward_sources import EnvironmentRewardSource, FunctionRewardSource
    from nemo_aligner.utils.errors import ConfigError
    from nemo_aligner.utils.tokenizers import ByteTokenizer

    function = FunctionRewardSource(lambda p, r: 0.0, ByteTokenizer())
    with pytest.raises(ConfigError, match=r"model\.grpo\.max_rollout_turns=2: only an environment plays several turns"):
        check_rollout_turns({"max_rollout_turns": 2}, "grpo", function)
    for bad in (0, "2", 1.5, True):
        with pytest.raises(ConfigError, match=r"model\.rs\.max_rollout_turns=.* must be an integer >= 1"):
            check_rollout_turns({"max_rollout_turns": bad}, "rs", function)
    assert check_rollout_turns({}, "grpo", function) == 1
    assert check_rollout_turns({}, "grpo", function, shared_rollouts=True) == 1

    class Endless:
        def step(self, conversations, metadata=None):
            from nemo_aligner.environments import EnvironmentReturn

            return EnvironmentReturn([1.0] * len(conversations), [False] * len(conversations),
                                     [{"role": "user", "content": " then: "}] * len(conversations))

    policy = ScriptedPolicy({0: ["a", "b", "c"]})
    tok = policy.tokenizer
    with caplog.at_level("WARNING"):
        batch = play_episodes(policy, EnvironmentRewardSource(Endless(), tok), [tok.text_to_ids("#0 =")], None, 4, 0,
                              None, 2, Timer(), EpisodeStats(), "model.grpo.max_rollout_turns")
    assert batch["_futures"][0].result().tolist() == [2.0] and batch["turns"].tolist() == [2]
    environment = EnvironmentRewardSource(Endless(), tok)
    assert check_rollout_turns({"max_rollout_turns": 2}, "grpo", environment) == 2
    with pytest.raises(ConfigError, match=r"trainer\.grpo\.batch_iterator\.use_flask=True is not supported with "
                                          r"model\.grpo\.max_rollout_turns=2"):
        check_rollout_turns({"max_rollout_turns": 2}, "grpo", environment, shared_rollouts=True)
    assert "were cut there; raise model.grpo.max_rollout_turns" in caplog.text

    class Mute(Endless):
        def step(self, conversations, metadata=None):
            out = super().step(conversations, metadata)
            out.observations = [None] * len(conversations)
            return out

    with pytest.raises(ConfigError, match="left conversation 0 not done but its observation is None"):
        play_episodes(policy, EnvironmentRewardSource(Mute(), tok), [tok.text_to_ids("#0 =")], None, 4, 0, None, 2,
                      Timer(), EpisodeStats(), "model.grpo.max_rollout_turns")


@pytest.mark.learning
@pytest.mark.parametrize("seed", [1234, 7, 11])
def test_grpo_raises_the_task_reward(tmp_path, weak_policy, seed):
    """GRPO (Python API, the task's own scorer) from a partly trained SFT model, 80 steps of 16 prompts x 8
    at lr 1e-4, for three seeds: the mean sampled reward of the last 20 steps is above the first 20's by
    more than 0.05 (measured +0.10 for each: ~0.61 -> 0.71) and greedy validation on 64 held-out prompts
    does not fall by more than its noise (0.748 -> 0.788, 0.713, 0.753)."""
    import json

    from nemo_aligner import GRPOTrainer
    from nemo_aligner.data.nlp.builtin_task import BuiltinTask

    model, data = weak_policy
    trainer = GRPOTrainer.from_pretrained(model, num_prompts_per_step=16, num_generations_per_prompt=8,
                                          learning_rate=1e-4, max_sequence_length=64, max_new_tokens=9,
                                          global_batch_size=64, micro_batch_size=16, seed=seed, val_period=80,
                                          save_period=0, output_dir=str(tmp_path / "grpo"))
    result = trainer.fit(dataset=data["prompts_train"], val_dataset=data["prompts_val"], reward_fn=BuiltinTask.score,
                         max_steps=80)
    rows = [json.loads(line) for line in open(tmp_path / "grpo" / "fit_1" / "metrics.jsonl")]
    rewards = [r["train/rewards"] for r in rows if "train/rewards" in r]
    val = {r["step"]: r["val/global_rewards"] for r in rows if "val/global_rewards" in r}
    first, last = sum(rewards[:20]) / 20, sum(rewards[-20:]) / 20
    print(f"GRPO seed {seed}: sampled reward {first:.3f} -> {last:.3f}; greedy validation {val}")
    assert result.total_steps == 80 and len(rewards) == 80 and sorted(val) == [0, 80]
    assert last > first + 0.05, (first, last)
    assert val[80] > val[0] - 0.05, val


def grpo_dp2(log_dir, model, data, *extra):
    return run_script("train_gpt_grpo.py", [
        f"pretrained_checkpoint.restore_from_path={model}",
        f"++model.data.data_prefix={{train: [{data['prompts_train']}], validation: [{data['prompts_val']}]}}",
        "reward_fn=nemo_aligner.data.nlp.builtin_task:reward", f"exp_manager.explicit_log_dir={log_dir}",
        "trainer.grpo.max_steps=1", "trainer.grpo.max_epochs=100", "trainer.grpo.val_check_interval=1",
        "model.grpo.num_rollout_samples=8", "model.grpo.num_responses_per_prompt=4", "model.grpo.rollout_micro_batch_size=4",
        "model.grpo.num_val_samples=12", "model.grpo.val_rollout_micro_batch_size=4",
        "model.global_batch_size=32", "model.micro_batch_size=8", "model.grpo.length_params.max_length=9",
        "model.optim.lr=5e-5", "trainer.devices=2", *extra], nproc=2)


def test_shared_rollouts_train_exactly_like_split_ones(tmp_path, quick_sft, builtin_data):
    """GRPO at data parallel 2: with use_flask the same responses (each micro-batch keeps its owner's seed),
    rewards, losses and validation scores as with the even split."""
    grpo_dp2(tmp_path / "split", quick_sft, builtin_data)
    grpo_dp2(tmp_path / "shared", quick_sft, builtin_data, "trainer.grpo.batch_iterator.use_flask=True")
    split, shared = read_metrics(tmp_path / "split"), read_metrics(tmp_path / "shared")
    keys = ("train/rewards", "train/actor_loss", "train/kl_loss", "train/response_length", "val/global_rewards")
    for key in keys:
        a = [(r["step"], r[key]) for r in split if key in r]
        b = [(r["step"], r[key]) for r in shared if key in r]
        assert a and len(a) == len(b), key
        assert [s for s, _ in a] == [s for s, _ in b]
        assert [v for _, v in b] == pytest.approx([v for _, v in a], rel=1e-6, abs=1e-7), key
    assert any("train/time/generate_share" in r for r in shared)  # the shared path ran
    assert not any("train/time/generate_share" in r for r in split)

