"""Mutation check of the RL and preference maths: flip one sign, mask or index at a time in a copy of
the source and show that the tests of that function fail.

    python tests/mutation/mutate.py            # every mutation (about 3 minutes on 2 cores)
    python tests/mutation/mutate.py --list     # what would be changed
    python tests/mutation/mutate.py --only gae_values_unmasked,dpo_sft_on_rejected

Each mutation replaces one exact piece of source text (it must occur once) in a copy of the working
tree under a temporary directory and runs its tests there; the working tree is never modified. Exit
status 0 when the unmutated tests pass and every mutation is caught, 1 otherwise.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import List, NamedTuple

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PPO = "nemo_aligner/utils/ppo_utils.py"
PREF = "nemo_aligner/utils/preference_losses.py"
RM = "nemo_aligner/models/nlp/gpt/megatron_gpt_reward_model.py"
DPO_MODEL = "nemo_aligner/models/nlp/gpt/megatron_gpt_dpo_model.py"
REINFORCE = "nemo_aligner/algorithms/reinforce.py"
ACTOR = "nemo_aligner/models/nlp/gpt/megatron_gpt_ppo_actor.py"
KD = "nemo_aligner/utils/kd_losses.py"
KD_MODEL = "nemo_aligner/models/nlp/gpt/megatron_gpt_knowledge_distillation.py"
STEERLM2 = "nemo_aligner/models/nlp/gpt/gpt_steerlm2_model.py"
MULTI_TURN = "nemo_aligner/algorithms/multi_turn.py"
SHARING = "nemo_aligner/utils/prompt_sharing.py"

# The tests each group of mutations must fail: fast, in-process, no training runs.
T_PPO = ["tests/test_ppo_utils.py"]
T_ACTOR = ["tests/test_ppo_actor.py"]
T_GROUP = ["tests/test_reinforce.py::test_leave_one_out_baseline_excludes_the_sample_itself",
           "tests/test_reinforce.py::test_responses_cut_at_max_length_set_no_baseline",
           "tests/test_grpo.py::test_group_normalised_advantages", "tests/test_ppo_utils.py"]
T_DPO = ["tests/test_dpo.py::test_dpo_is_minus_log_sigmoid_of_beta_margin", "tests/test_dpo.py::test_ipo_squared_form",
         "tests/test_dpo.py::test_rpo_losses_use_ground_truth_rewards", "tests/test_dpo.py::test_sequence_logps_sum_and_mean",
         "tests/test_dpo.py::test_objective_adds_the_nll_of_the_chosen_responses",
         "tests/test_dpo.py::test_logged_metrics_equal_an_independent_computation"]
T_RM = ["tests/test_reward_model.py::test_pairwise_loss_and_accuracy_by_hand",
        "tests/test_reward_model.py::test_logged_loss_equals_the_pairwise_loss_of_the_models_rewards"]
T_BT = ["tests/test_reward_model.py::test_preference_pair_losses_by_hand",
        "tests/test_reward_model.py::test_bt_logged_loss_equals_the_pair_loss_of_the_models_rewards"]
T_KTO = ["tests/test_kto.py::test_kto_loss_by_hand"]
T_RS = ["tests/test_rs.py::test_top_n_per_group_by_hand"]
T_MSE = ["tests/test_reward_model.py::test_masked_mse_ignores_missing_attributes",
         "tests/test_reward_model.py::test_missing_attributes_use_the_configured_mask_value"]
T_KD = ["tests/test_knowledge_distillation.py::test_topk_kl_losses_by_hand",
        "tests/test_knowledge_distillation.py::test_student_loss_from_its_own_logits"]
T_STEERLM2 = ["tests/test_steerlm2.py::test_importance_weights_and_baseline_by_hand",
              "tests/test_steerlm2.py::test_weighted_loss_from_the_models_own_logits"]
T_TURNS = ["tests/test_grpo.py::test_every_turn_of_a_two_step_environment_counts",
           "tests/test_grpo.py::test_an_episodes_reward_is_the_sum_of_its_turns"]
T_K3 = ["tests/test_grpo.py::test_k3_kl_by_hand_and_its_properties"]


class Mutation(NamedTuple):
    name: str
    path: str
    old: str
    new: str
    tests: List[str]


MUTATIONS = [
    # GAE and PPO's per-token rewards
    Mutation("gae_values_unmasked", PPO, "        values = values * mask\n", "", T_PPO),
    Mutation("gae_rewards_unmasked", PPO, "        rewards = rewards * mask\n", "", T_PPO),
    Mutation("gae_lambda_dropped", PPO, "discount_factor * gae_lambda * running", "discount_factor * running", T_PPO),
    Mutation("gae_next_value_undiscounted", PPO, "rewards[:, t] + discount_factor * next_value", "rewards[:, t] + next_value", T_PPO),
    Mutation("ppo_reward_kl_sign", PPO, "per_token = -kl_penalty * kl", "per_token = kl_penalty * kl", T_PPO),
    Mutation("ppo_reward_on_eos_position", PPO, "last = (response_lengths - 2)", "last = (response_lengths - 1)", T_PPO),
    Mutation("mask_starts_one_late", PPO, "(positions >= (prompt_lengths - 1)", "(positions >= prompt_lengths", T_PPO),
    Mutation("kl_direction", PPO, "kl = logprobs - init_logprobs", "kl = init_logprobs - logprobs", T_PPO),
    Mutation("k3_form", PPO, "return torch.exp(delta) - delta - 1.0", "return torch.exp(delta) + delta - 1.0", T_PPO + T_K3),
    Mutation("absolute_kl_ignored", PPO, "return kl.abs() if use_absolute_kl else kl", "return kl", T_PPO),
    Mutation("mask_covers_the_last_prediction", PPO, "(positions < (response_lengths - 1).unsqueeze(1))",
             "(positions < response_lengths.unsqueeze(1))", T_PPO),
    Mutation("k3_direction", PPO, "delta = ref_logprobs - logprobs", "delta = logprobs - ref_logprobs", T_PPO),
    Mutation("whitening_keeps_the_mean", PPO, "return (advantages - mean) * torch.rsqrt", "return advantages * torch.rsqrt", T_PPO),
    # the actor's losses
    Mutation("surrogate_min_not_max", PPO, "surrogate = torch.max(-advantages * ratio", "surrogate = torch.min(-advantages * ratio", T_PPO),
    Mutation("ratio_inverted", PPO, "ratio = torch.exp(logprobs - old_logprobs)", "ratio = torch.exp(old_logprobs - logprobs)",
             T_PPO + T_ACTOR),
    Mutation("entropy_bonus_sign", PPO, "loss = loss - entropy_bonus * mean_entropy", "loss = loss + entropy_bonus * mean_entropy", T_PPO),
    Mutation("grpo_kl_loss_sign", PPO, "loss = loss + kl_loss_coef * kl", "loss = loss - kl_loss_coef * kl", T_PPO + T_ACTOR),
    Mutation("actor_kl_coef_dropped", ACTOR, "kl_loss_coef=self.kl_loss_coef)", "kl_loss_coef=0.0)", T_ACTOR),
    Mutation("actor_loss_unmasked", PPO, "loss = masked_mean(surrogate, mask)", "loss = surrogate.mean()", T_PPO),
    Mutation("labels_not_shifted", SHARING, "return torch.cat((tokens[:, 1:], tokens[:, -1:]), dim=1)", "return tokens",
             T_ACTOR),
    Mutation("critic_value_clip_dropped", PPO, "clipped = prev_values + (values - prev_values).clamp(-clip_val, clip_val)",
             "clipped = values", T_PPO),
    Mutation("critic_loss_min_not_max", PPO, "loss = torch.max((clipped - returns) ** 2", "loss = torch.min((clipped - returns) ** 2", T_PPO),
    # critic-free baselines and rewards
    Mutation("rloo_reward_kl_sign", PPO, "return rewards - kl_penalty * kl.sum(-1)", "return rewards + kl_penalty * kl.sum(-1)", T_PPO),
    Mutation("rloo_baseline_includes_self", PPO, "others = same - torch.eye(", "others = same + 0 * torch.eye(", T_GROUP),
    Mutation("group_std_not_sqrt", REINFORCE, "advantages / (var.sqrt() + eps)", "advantages / (var + eps)", T_GROUP),
    Mutation("cut_rows_in_baseline", REINFORCE, 'self.normalize_rewards,\n                                      valid=batch["is_end"])',
             'self.normalize_rewards)', T_PPO),
    Mutation("top_n_lowest", PPO, "(not bool(valid[i]), -float(rewards[i]))", "(not bool(valid[i]), float(rewards[i]))", T_RS),
    Mutation("top_n_ignores_validity", PPO, "key=lambda i: (not bool(valid[i]), ", "key=lambda i: (False, ", T_RS),
    Mutation("episode_reward_is_the_last_turns", MULTI_TURN, "rewards[i] += step_rewards[k]", "rewards[i] = step_rewards[k]",
             T_TURNS),
    # preference losses
    Mutation("dpo_sign", PREF, "return -F.logsigmoid(beta * delta)", "return -F.logsigmoid(-beta * delta)", T_DPO),
    Mutation("ipo_target", PREF, "(delta - 1.0 / (2.0 * beta)) ** 2", "(delta - 1.0 / beta) ** 2", T_DPO),
    Mutation("rpo_sq_scale_dropped", PREF, "gt_delta = gt_reward_scale * (gt_chosen - gt_rejected)", "gt_delta = gt_chosen - gt_rejected", T_DPO),
    Mutation("average_over_width", PREF, "total / mask.sum(-1).clamp(min=1.0)", "total / mask.shape[-1]", T_DPO),
    Mutation("rpo_bwd_kl_is_forward", PREF, "return sum(g.exp() * (g - p) for g, p in zip(log_gt, log_policy))",
             "return sum(p.exp() * (p - g) for g, p in zip(log_gt, log_policy))", T_DPO),
    Mutation("dpo_accuracy_reversed", PREF, '"correct": ((chosen > rejected)', '"correct": ((chosen < rejected)', T_DPO),
    Mutation("dpo_sft_sign", PREF, '"sft_loss_sum": (-chosen_logps * weight).sum()', '"sft_loss_sum": (chosen_logps * weight).sum()', T_DPO),
    Mutation("dpo_sft_on_rejected", DPO_MODEL, "sequence_logps(logps[:half], mask[:half], self.sft_average)",
             "sequence_logps(logps[half:], mask[half:], self.sft_average)", T_DPO),
    Mutation("kto_desirable_sign", PREF, "(1 - torch.sigmoid(beta * (ratio - z)))", "(1 - torch.sigmoid(beta * (z - ratio)))", T_KTO),
    Mutation("kto_undesirable_sign", PREF, "(1 - torch.sigmoid(beta * (z - ratio)))", "(1 - torch.sigmoid(beta * (ratio - z)))",
             T_KTO),
    Mutation("kto_reference_point_unclamped", PREF, "z = kl_estimate.detach().clamp(min=0.0)", "z = kl_estimate.detach()", T_KTO),
    Mutation("kto_weights_swapped", PREF, "desirable * desirable_weight *", "desirable * undesirable_weight *", T_KTO),
    # knowledge distillation
    Mutation("kd_forward_is_backward", KD, "return (log_p_t.exp() * (log_p_t - log_p_s)).sum(-1)",
             "return (log_p_s.exp() * (log_p_s - log_p_t)).sum(-1)", T_KD),
    Mutation("kd_sft_unmasked", KD_MODEL, 'mb["labels"]) * mask).sum()', 'mb["labels"])).sum()', T_KD),
    # SteerLM 2.0's importance weights
    Mutation("steerlm2_baseline_sign", STEERLM2, "(-row_nll.double() - log_q.double())", "(row_nll.double() - log_q.double())",
             T_STEERLM2),
    Mutation("steerlm2_weights_reversed", STEERLM2, "return (ws - base).reshape(-1)", "return (base - ws).reshape(-1)",
             T_STEERLM2),
    # reward model
    Mutation("rm_loss_sign", RM, '{"loss_sum": -(weight * F.logsigmoid(chosen - rejected)).sum()',
             '{"loss_sum": (weight * F.logsigmoid(chosen - rejected)).sum()', T_RM),
    Mutation("rm_accuracy_reversed", RM, "(weight * (chosen > rejected).to(chosen.dtype)).sum()",
             "(weight * (chosen < rejected).to(chosen.dtype)).sum()", T_RM),
    Mutation("rm_mse_unmasked", RM, "mask = (labels != mask_value).to(pred.dtype)", "mask = torch.ones_like(pred)", T_MSE),
    # a regression reward model's Bradley-Terry losses (HelpSteer2-Preference pairs)
    Mutation("bt_preferred_side", PREF, "chosen = torch.where(strength < 0, first, second)",
             "chosen = torch.where(strength > 0, first, second)", T_BT),
    Mutation("bt_margin_sign", PREF, "losses = -F.logsigmoid(diff - margin)", "losses = -F.logsigmoid(diff + margin)", T_BT),
    Mutation("scaled_bt_unscaled", PREF, "losses = margin * -F.logsigmoid(diff)", "losses = -F.logsigmoid(diff)", T_BT),
]


def copy_tree(dest: str) -> None:
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, check=True,
                           capture_output=True, text=True).stdout.splitlines()
    for rel in files:
        src = os.path.join(ROOT, rel)
        if os.path.isfile(src):
            os.makedirs(os.path.dirname(os.path.join(dest, rel)) or dest, exist_ok=True)
            shutil.copy2(src, os.path.join(dest, rel))


def run_tests(tree: str, tests: List[str]) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=tree + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-o", "addopts=", *tests]
    return subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=900)


def first_failure(output: str) -> str:
    for line in output.splitlines():
        if line.startswith("FAILED ") or line.startswith("ERROR "):
            return line.split(" ", 1)[1].split(" - ")[0]
    return "?"


def check_sources(mutations: List[Mutation], root: str = ROOT) -> List[str]:
    """Problems with the table: a piece of source text missing, or found more than once."""
    problems = []
    for m in mutations:
        with open(os.path.join(root, m.path), encoding="utf-8") as f:
            count = f.read().count(m.old)
        if count != 1:
            problems.append(f"{m.name}: {m.old!r} occurs {count} times in {m.path} (must be once)")
    return problems


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", default="", help="comma-separated mutation names")
    parser.add_argument("--list", action="store_true", help="print the mutations and exit")
    args = parser.parse_args(argv)
    chosen = MUTATIONS
    if args.only:
        names = set(args.only.split(","))
        unknown = names - {m.name for m in MUTATIONS}
        if unknown:
            print(f"--only: no mutation named {sorted(unknown)}", file=sys.stderr)
            return 2
        chosen = [m for m in MUTATIONS if m.name in names]
    if args.list:
        for m in chosen:
            print(f"{m.name:<30} {m.path}: {m.old.strip()!r} -> {m.new.strip()!r}")
        return 0
    problems = check_sources(chosen)
    if problems:
        print("\n".join(problems), file=sys.stderr)
        return 2
    survived = []
    with tempfile.TemporaryDirectory(prefix="mutation-") as tree:
        copy_tree(tree)
        tests = sorted({t for m in chosen for t in m.tests})
        base = run_tests(tree, tests)
        if base.returncode != 0:
            print(f"the unmutated tests fail; fix them first:\n{base.stdout[-3000:]}", file=sys.stderr)
            return 1
        print(f"unmutated: {len(tests)} test selections pass")
        for m in chosen:
            path = os.path.join(tree, m.path)
            with open(path, encoding="utf-8") as f:
                original = f.read()
            with open(path, "w", encoding="utf-8") as f:
                f.write(original.replace(m.old, m.new, 1))
            start = time.time()
            try:
                result = run_tests(tree, m.tests)
            finally:
                with open(path, "w", encoding="utf-8") as f:
                    f.write(original)
            caught = result.returncode != 0
            verdict = f"caught by {first_failure(result.stdout)}" if caught else "SURVIVED"
            print(f"{m.name:<30} {verdict} ({time.time() - start:.0f} s)", flush=True)
            if not caught:
                survived.append(m.name)
    print(f"\n{len(chosen) - len(survived)} of {len(chosen)} mutations caught" +
          (f"; survived: {', '.join(survived)}" if survived else ""))
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
