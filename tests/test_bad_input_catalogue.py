"""The bad-input catalogue, in process (fast): each case raises the project's error type with a
message that names the file and line, the config key, or the checkpoint and the mismatch, and
leaves every file already on disk (the input itself, an earlier run's checkpoint) unchanged.

Whole-script versions of the common cases (one `error:` line, exit status 1, no traceback) are in
tests/test_bad_input.py; server request errors are in tests/test_reward_server.py."""

import hashlib
import logging
import os
import tarfile

import pytest
from omegaconf import OmegaConf

from conftest import TINY_ARCH, TINY_GPT2_ARCH
from nemo_aligner.utils.errors import CheckpointError, ConfigError, DataError
from nemo_aligner.utils.tokenizers import ByteTokenizer


def snapshot(root):
    """Path -> sha256 of every file under ``root``."""
    out = {}
    for base, _, files in os.walk(root):
        for name in files:
            path = os.path.join(base, name)
            with open(path, "rb") as f:
                out[path] = hashlib.sha256(f.read()).hexdigest()
    return out


@pytest.fixture
def workdir(tmp_path):
    """A directory holding an earlier run's checkpoint; every case must leave it (and its own input) as it was."""
    ckpt = tmp_path / "earlier_run" / "checkpoints" / "step=2"
    ckpt.mkdir(parents=True)
    (ckpt / "trainer_state.json").write_text('{"step": 2}')
    (ckpt / "weights.bin").write_bytes(os.urandom(256))
    return tmp_path


def check(workdir, error, pattern, fn):
    before = snapshot(workdir)
    with pytest.raises(error, match=pattern):
        fn()
    assert snapshot(workdir) == before


def write(workdir, name, text=None, data=None):
    path = workdir / name
    if data is not None:
        path.write_bytes(data)
    else:
        path.write_text(text, encoding="utf-8")
    return str(path)


# ----------------------------------------------------------------- jsonl files
def sft(path, **kw):
    from nemo_aligner.data.nlp.sft_dataset import GPTSFTDataset

    return GPTSFTDataset(path, ByteTokenizer(), 32, **kw)


def chat(path):
    from nemo_aligner.data.nlp.sft_dataset import GPTSFTChatDataset

    return GPTSFTChatDataset(path, ByteTokenizer(), 32)


def rm(path):
    from nemo_aligner.data.nlp.reward_datasets import RewardComparisonDataset

    return RewardComparisonDataset(path, ByteTokenizer(), 32)


def regression(path):
    from nemo_aligner.data.nlp.reward_datasets import RegressionRewardDataset

    return RegressionRewardDataset(path, ByteTokenizer(), 32, num_attributes=9)


def dpo(path):
    from nemo_aligner.data.nlp.dpo_dataset import DPOPairDataset

    return DPOPairDataset(path, ByteTokenizer(), 32)


def kto(path):
    from nemo_aligner.data.nlp.kto_dataset import KTODataset

    return KTODataset(path, ByteTokenizer(), 32)


def prompts(path):
    from nemo_aligner.data.nlp.prompt_dataset import PromptDataset

    return PromptDataset(path, ByteTokenizer(), 16)


GOOD_PAIR = '{"text": "reverse abc = cba"}\n{"text": "reverse abc = bca"}\n'
JSONL_CASES = {
    "sft-non-utf8": (sft, None, b'{"input": "a =", "output": "b"}\n{"input": "\xff\xfe", "output": "c"}\n',
                     r"bad\.jsonl:2: not UTF-8 text \(byte 0xff at column 12\)"),
    "sft-empty-answer": (sft, '{"input": "a =", "output": ""}\n', None, r"bad\.jsonl:1: field 'output' is empty"),
    "sft-missing-template-field": (lambda p: sft(p, prompt_template="{question} {output}"),
                                   '{"input": "a =", "output": "b"}\n', None,
                                   r"bad\.jsonl:1: missing field 'question' \(found \['input', 'output'\]\)"),
    "sft-directory": (lambda p: sft(os.path.dirname(p)), "{}\n", None, r"is a directory, expected a \.jsonl file"),
    "chat-empty-conversation": (chat, '{"system": "", "conversations": []}\n', None,
                                r"bad\.jsonl:1: field 'conversations' is empty"),
    "rm-odd-number-of-lines": (rm, GOOD_PAIR + '{"text": "sort ba = ab"}\n', None,
                               r"bad\.jsonl:3: odd number of records \(3\); comparisons come in pairs"),
    "rm-chosen-rejected-mismatch": (rm, '{"text": "reverse abc = cba"}\n{"text": "sort hgfe = efgh"}\n', None,
                                    r"bad\.jsonl:2: this rejected text does not start with the prompt of the "
                                    r"chosen text on line 1"),
    "rm-empty-text": (rm, '{"text": "reverse abc = cba"}\n{"text": ""}\n', None, r"bad\.jsonl:2: field 'text' is empty"),
    "rm-text-wrong-type": (rm, '{"text": ["reverse"]}\n{"text": "x"}\n', None,
                           r"bad\.jsonl:1: field 'text' must be str, got list"),
    "regression-bad-label": (regression, '{"text": "a", "label": "quality:x"}\n', None,
                             r"bad\.jsonl:1: attribute 'quality' has a value that is not a finite number: 'x'"),
    "dpo-without-rejected": (dpo, '{"prompt": "p", "chosen_response": "a"}\n', None,
                             r"bad\.jsonl:1: missing field 'rejected_response'"),
    "dpo-empty-chosen": (dpo, '{"prompt": "p", "chosen_response": "", "rejected_response": "b"}\n', None,
                         r"bad\.jsonl:1: field 'chosen_response' is empty"),
    "dpo-reward-not-a-number": (dpo, '{"prompt": "p", "chosen_response": "a", "rejected_response": "b", '
                                     '"chosen_reward": "high"}\n', None,
                                r"bad\.jsonl:1: field 'chosen_reward' must be a number, got str"),
    "kto-empty-response": (kto, '{"prompt": "p", "response": "", "preference": "desired"}\n', None,
                           r"bad\.jsonl:1: field 'response' is empty"),
    "ppo-empty-prompt": (prompts, '{"text": ""}\n', None, r"bad\.jsonl:1: field 'text' is empty"),
    "blank-lines-only": (sft, "\n   \n\n", None, r"bad\.jsonl: file is empty \(no JSON records\)"),
    "sft-wrong-type": (sft, '{"input": "a =", "output": 5}\n', None, r"bad\.jsonl:1: field 'output' must be str, got int"),
    "sft-not-an-object": (sft, '["input", "output"]\n', None, r"bad\.jsonl:1: expected a JSON object, got list"),
    "regression-nan-label": (regression, '{"text": "a", "label": [1, 2, 3, 4, 0, 1, 2, 3, 3]}\n'
                                         '{"text": "b", "label": [NaN, 1, 2, 3, 4, 0, 1, 2, 3]}\n', None,
                             r"bad\.jsonl:2: field 'label\[0\]' is not a finite number \(JSON has no NaN or Infinity\)"),
    "regression-inf-in-a-string-label": (regression, '{"text": "a", "label": "quality:4,toxicity:inf"}\n', None,
                                         r"bad\.jsonl:1: attribute 'toxicity' has a value that is not a finite "
                                         r"number: 'inf'"),
    "regression-bool-label": (regression, '{"text": "a", "label": [true, 1, 2, 3, 4, 0, 1, 2, 3]}\n', None,
                              r"bad\.jsonl:1: label values must be finite numbers"),
    "dpo-nan-reward": (dpo, '{"prompt": "p", "chosen_response": "a", "rejected_response": "b", '
                            '"chosen_reward": -Infinity}\n', None,
                       r"bad\.jsonl:1: field 'chosen_reward' is not a finite number"),
    "dpo-chat-content-not-a-string": (dpo, '{"prompt": [{"role": "user", "content": 7}], "chosen_response": "a", '
                                           '"rejected_response": "b"}\n', None,
                                      r"bad\.jsonl:1: prompt\[0\]\.content must be str, got int"),
    "chat-value-not-a-string": (chat, '{"conversations": [{"from": "User", "value": 5}, '
                                      '{"from": "Assistant", "value": "x"}]}\n', None,
                                r"bad\.jsonl:1: conversations\[0\]\.value must be str, got int"),
    "chat-null-value": (chat, '{"conversations": [{"from": "User", "value": "hi"}, '
                              '{"from": "Assistant", "value": null}]}\n', None,
                        r"bad\.jsonl:1: conversations\[1\]\.value must be str, got NoneType"),
    "sft-lone-surrogate": (sft, '{"input": "a =", "output": "b"}\n{"input": "x \\ud800", "output": "c"}\n', None,
                           r"bad\.jsonl:2: field 'input' is not valid Unicode text"),
    "chat-mask-not-a-string": (chat, '{"conversations": [{"from": "User", "value": "hi"}, '
                                     '{"from": "Assistant", "value": "yo"}], "mask": 3}\n', None,
                               r"bad\.jsonl:1: field 'mask' must be str, got int"),
}


@pytest.mark.parametrize("case", list(JSONL_CASES))
def test_bad_jsonl(workdir, case):
    build, text, data, pattern = JSONL_CASES[case]
    path = write(workdir, "bad.jsonl", text, data)
    check(workdir, DataError, pattern, lambda: build(path))


TEMPLATE_CASES = {
    "unbalanced": ("{input {output}", r"prompt_template='\{input \{output\}' is not a valid template"),
    "positional": ("{0} {output}", r"prompt_template='\{0\} \{output\}': \{0\} is not a record field name"),
    "attribute": ("{input.upper} {output}", r"\{input\.upper\} is not a record field name"),
    "null": (None, r"prompt_template=null: prompt/answer records need a template such as '\{input\} \{output\}' "
                   r"\(model\.data\.chat=True reads chat records without one\)"),
}


@pytest.mark.parametrize("case", list(TEMPLATE_CASES))
def test_bad_prompt_template(workdir, case):
    template, pattern = TEMPLATE_CASES[case]
    path = write(workdir, "bad.jsonl", '{"input": "a =", "output": "b"}\n')
    check(workdir, ConfigError, pattern, lambda: sft(path, prompt_template=template))


def test_overlong_record_is_truncated_with_a_warning_naming_it(workdir, caplog):
    path = write(workdir, "long.jsonl", '{"input": "a =", "output": "b"}\n{"input": "' + "x" * 500 + ' =", "output": "y"}\n')
    before = snapshot(workdir)
    dataset = sft(path)
    with caplog.at_level(logging.WARNING):
        short, long = dataset[0], dataset[1]
    assert len(short["input_ids"]) < 10 and len(long["input_ids"]) == 33  # max_seq_length + 1 (the shifted label)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "long.jsonl:2:" in warnings[0] and "max_seq_length=32" in warnings[0], warnings
    assert snapshot(workdir) == before


# ----------------------------------------------------------------- config
def sft_config(**overrides):
    cfg = OmegaConf.load(os.path.join(os.path.dirname(__file__), "..", "examples", "nlp", "gpt", "conf", "gpt_sft.yaml"))
    for key, value in overrides.items():
        OmegaConf.update(cfg, key, value, force_add=False)
    return cfg


def config_values(**overrides):
    from nemo_aligner.utils.config_checks import check_config_values

    return lambda: check_config_values(sft_config(**overrides))


def schedule_values(**overrides):
    """The start-up schedule checks on gpt_sft.yaml with ``overrides`` (dotted keys under model.optim)."""
    from nemo_aligner.utils.optim import check_schedule

    def check():
        cfg = sft_config()
        for key, value in overrides.items():
            OmegaConf.update(cfg, key, value, force_add=True)
        check_schedule(cfg.model.optim)
    return check


def section_values(section: str, **values):
    """The value checks on a config holding ``values`` under ``section`` (``inference``, ``trainer.ppo``)."""
    from nemo_aligner.utils.config_checks import check_config_values

    cfg = OmegaConf.create()
    OmegaConf.update(cfg, section, values, force_add=True)
    return lambda: check_config_values(cfg)


def reward_model_with(**values):
    from nemo_aligner.models.nlp.gpt.megatron_gpt_reward_model import MegatronGPTRewardModel
    from nemo_aligner.utils.tokenizers import ByteTokenizer

    return lambda: MegatronGPTRewardModel(OmegaConf.create(dict(TINY_ARCH, **values)), ByteTokenizer())


def group_sampling(**values):
    from nemo_aligner.algorithms.reinforce import check_group_sampling

    return lambda: check_group_sampling(OmegaConf.create(values), "grpo")


def copied_value():
    from nemo_aligner.utils.config_checks import check_config_values

    cfg = OmegaConf.create({"trainer": {"ppo": {"trt_llm": {"seed": "${model.seed}"}}}, "model": {"seed": "abc"}})
    return lambda: check_config_values(cfg)


def value_shapes(**overrides):
    from nemo_aligner.utils.config_keys import check_value_shapes

    return lambda: check_value_shapes(sft_config(**overrides), sft_config())


def lora_config(**overrides):
    from nemo_aligner.models.nlp.gpt.lora import lora_settings

    overrides.setdefault("model.peft.peft_scheme", "lora")
    return lambda: lora_settings(sft_config(**overrides).model)


def run_limits(**overrides):
    from nemo_aligner.utils.config_checks import check_run_limits_keys

    return lambda: check_run_limits_keys(sft_config(**overrides))


def parallel(world, tp, pp, heads, groups, layers):
    from nemo_aligner.utils.distributed import check_parallel_sizes

    return lambda: check_parallel_sizes(world, tp, pp, heads, groups, layers)


def server_limits():
    from nemo_aligner.servers.batching import check_batch_limits

    return lambda: check_batch_limits(8, 4, 4, "trainer.ppo.max_batch_size", "trainer.ppo.inference_micro_batch_size")


def rollout_batch_below_critic_round():
    """The actor's requests against a critic server batching 4 rows per rank x 2 data-parallel ranks."""
    from concurrent.futures import Future
    from types import SimpleNamespace

    from pytriton.model_config import DynamicBatcher

    from nemo_aligner.servers.clients import RemoteGPTRMCriticClient

    config = Future()
    config.set_result(SimpleNamespace(batcher=DynamicBatcher(preferred_batch_size=[8, 64])))
    client = object.__new__(RemoteGPTRMCriticClient)
    client.infer_client = SimpleNamespace(_client=SimpleNamespace(model_config=lambda: config), timeout_s=5,
                                          where="127.0.0.1:5567")
    client.check_request_sizes({"model.ppo.rollout_micro_batch_size": 8})  # one full round: fine
    return lambda: client.check_request_sizes({"model.ppo.rollout_micro_batch_size": 8,
                                               "model.ppo.val_rollout_micro_batch_size": 4})


def missing_data_path():
    from nemo_aligner.data.nlp.jsonl import read_jsonl_files

    return lambda: read_jsonl_files("???", "model.data.data_prefix.train")


def sequence_parallel(role):
    """A role whose sequence-parallel path is known to be wrong, given model.sequence_parallel=True."""
    from types import SimpleNamespace

    from nemo_aligner.models.nlp.gpt.megatron_gpt_ppo_actor import MegatronGPTActorModel
    from nemo_aligner.models.nlp.gpt.megatron_gpt_reward_model import MegatronGPTRewardModel
    from nemo_aligner.models.nlp.gpt.generation import LengthParams, SamplingParams, generate

    cfg = OmegaConf.create(dict(TINY_ARCH, sequence_parallel=True, tensor_model_parallel_size=2, micro_batch_size=1,
                                encoder_seq_length=32))
    if role == "generation":
        module = SimpleNamespace(config=SimpleNamespace(sequence_parallel=True))
        return lambda: generate(module, ByteTokenizer(), [[1, 2]], SamplingParams(), LengthParams(max_length=2))
    cls = {"actor": MegatronGPTActorModel, "reward": MegatronGPTRewardModel}[role]
    return lambda: cls(cfg, ByteTokenizer())


def dpo_beta(beta, loss="dpo"):
    from nemo_aligner.models.nlp.gpt.megatron_gpt_dpo_model import MegatronGPTDPOModel

    cfg = OmegaConf.create(dict(TINY_ARCH, micro_batch_size=1, encoder_seq_length=32,
                                dpo={"ref_policy_kl_penalty": beta, "preference_loss": loss}))
    return lambda: MegatronGPTDPOModel(cfg, ByteTokenizer())


def reinforce_one_response():
    from nemo_aligner.recipes.reinforce import run_reinforce_actor

    cfg = OmegaConf.load(os.path.join(os.path.dirname(__file__), "..", "examples", "nlp", "gpt", "conf",
                                      "gpt_reinforce_actor.yaml"))
    OmegaConf.update(cfg, "model.reinforce.num_responses_per_prompt", 1)
    OmegaConf.update(cfg, "trainer.reinforce.use_leave_one_out_baseline", False)
    return lambda: run_reinforce_actor(cfg)


def grpo_sampling(**overrides):
    from nemo_aligner.recipes.grpo import run_grpo

    cfg = OmegaConf.load(os.path.join(os.path.dirname(__file__), "..", "examples", "nlp", "gpt", "conf",
                                      "gpt_grpo.yaml"))
    for key, value in overrides.items():
        OmegaConf.update(cfg, key, value)
    return lambda: run_grpo(cfg)


def shipped_config(name, **overrides):
    """Shipped config ``name`` (its own keys only, no defaults list) with ``overrides`` (values replaced,
    not merged)."""
    cfg = OmegaConf.load(os.path.join(os.path.dirname(__file__), "..", "examples", "nlp", "gpt", "conf", f"{name}.yaml"))
    for key, value in overrides.items():
        OmegaConf.update(cfg, key, value, merge=False, force_add=False)
    return cfg


def shipped_config_values(name, **overrides):
    from nemo_aligner.utils.config_checks import check_config_values

    return lambda: check_config_values(shipped_config(name, **overrides))


def generate_config(**overrides):
    return shipped_config_values("gpt_generate", **overrides)


def generate_prompts(**overrides):
    from nemo_aligner.recipes.generate import read_prompts

    return lambda: read_prompts(shipped_config("gpt_generate", **overrides))


def text_server_bind(host="127.0.0.1", taken=False):
    """generate_gpt.py server=True's check of host/port before the model loads (port taken: a socket
    listens on it meanwhile)."""
    import socket

    from nemo_aligner.utils.ports import check_bindable

    def run():
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            sock.listen(1)
            check_bindable(host, {"port": sock.getsockname()[1] if taken else 0})

    return run


def eval_parallel_sizes(**overrides):
    from nemo_aligner.recipes.generate import apply_eval_parallel_sizes

    return lambda: apply_eval_parallel_sizes(shipped_config("gpt_generate", **overrides))


CONFIG_CASES = {
    "peft-ptuning": (lora_config(**{"model.peft.peft_scheme": "ptuning"}),
                     r"model\.peft\.peft_scheme='ptuning' is not supported \(supported: lora, none\)"),
    "lora-target": (lora_config(**{"model.peft.lora_tuning.target_modules": ["attention_qkv", "qkv"]}),
                    r"model\.peft\.lora_tuning\.target_modules: 'qkv' is not one of attention_qkv, "),
    "lora-dim": (lora_config(**{"model.peft.lora_tuning.adapter_dim": 0}),
                 r"model\.peft\.lora_tuning\.adapter_dim=0 must be a positive integer"),
    "lora-layers": (lora_config(**{"model.peft.lora_tuning.layer_selection": [1, 9]}),
                    r"model\.peft\.lora_tuning\.layer_selection: 9 is not a layer number \(1 to 2\)"),
    "lora-tying": (lora_config(**{"model.peft.lora_tuning.weight_tying": True}),
                   r"model\.peft\.lora_tuning\.weight_tying=True is not supported"),
    "top-level-max-steps": (run_limits(**{"trainer.max_steps": 100}),
                            r"trainer\.max_steps=100 is not read: this run's limit is trainer\.sft\.max_steps \(now -1\)"),
    "top-level-max-epochs": (run_limits(**{"trainer.max_epochs": 3}),
                             r"trainer\.max_epochs=3 is not read: this run's limit is trainer\.sft\.max_epochs"),
    "generate-negative-tokens": (generate_config(**{"inference.tokens_to_generate": -1}),
                                 r"inference\.tokens_to_generate=-1 must be >= 0"),
    "generate-zero-batch": (generate_config(batch_size=0), r"batch_size=0 must be > 0"),
    "generate-text-for-top-p": (generate_config(**{"inference.top_p": "abc"}),
                                r"inference\.top_p='abc' must be a number, got str"),
    "generate-list-for-a-prompt": (generate_prompts(prompts=[[1], "fine"]),
                                   r"prompts\[0\]=\[1\] must be text \(prompts: a list of strings\)"),
    "dict-for-end-strings": (shipped_config_values("gpt_grpo", **{"model.grpo.sampling_params.end_strings": {"x": 1}}),
                             r"model\.grpo\.sampling_params\.end_strings=\{'x': 1\} must be a list of strings"),
    "empty-end-string": (shipped_config_values("gpt_grpo", **{"model.grpo.sampling_params.end_strings": ["</s>", ""]}),
                         r"^model\.grpo\.sampling_params\.end_strings=\['</s>', ''\] holds an empty string"),
    "dpo-beta-zero": (dpo_beta(0.0, "ipo"), r"model\.dpo\.ref_policy_kl_penalty=0\.0 \(beta\) must be > 0"),
    "dpo-beta-negative": (dpo_beta(-0.1), r"model\.dpo\.ref_policy_kl_penalty=-0\.1 \(beta\) must be > 0"),
    "grpo-greedy-rollouts": (grpo_sampling(**{"model.grpo.sampling_params.use_greedy": True}),
                             r"model\.grpo\.sampling_params: use_greedy=True, temperature=1\.0 gives \d+ identical "
                             r"responses per prompt"),
    "grpo-temperature-zero": (grpo_sampling(**{"model.grpo.sampling_params.temperature": 0.0}),
                              r"model\.grpo\.sampling_params: use_greedy=False, temperature=0\.0 gives"),
    "reinforce-one-response-per-prompt": (reinforce_one_response(),
                                          r"model\.reinforce\.num_responses_per_prompt=1: the baseline comes from "
                                          r"the other responses"),
    "wrong-type-int": (config_values(**{"model.micro_batch_size": "eight"}),
                       r"model\.micro_batch_size='eight' must be an integer, got str"),
    "wrong-type-float": (config_values(**{"model.optim.lr": "fast"}), r"model\.optim\.lr='fast' must be a number"),
    "bool-for-int": (config_values(**{"model.data.train_ds.micro_batch_size": True}),
                     r"model\.data\.train_ds\.micro_batch_size=True must be an integer"),
    "list-for-int": (config_values(**{"model.micro_batch_size": [1]}),
                     r"model\.micro_batch_size=\[1\] must be an integer, got a list"),
    "dict-for-number": (config_values(**{"model.optim.lr": {"x": 1}}),
                        r"model\.optim\.lr=\{'x': 1\} must be a number, got a dict"),
    "number-for-text": (config_values(**{"model.data.train_ds.label_key": -5}),
                        r"model\.data\.train_ds\.label_key=-5 must be text, got int"),
    "null-seed": (config_values(**{"model.seed": None}), r"model\.seed=null: this key needs a value"),
    "null-micro-batch": (config_values(**{"model.micro_batch_size": None}),
                         r"model\.micro_batch_size=null: this key needs a value"),
    "list-for-a-path": (generate_config(prompts_file=[1]), r"prompts_file=\[1\] must be one path, got a list"),
    "number-for-a-path": (config_values(**{"exp_manager.explicit_log_dir": 5}),
                          r"exp_manager\.explicit_log_dir=5 must be one path, got int \(quote a name made of digits: "
                          r"explicit_log_dir='5'\)"),
    "null-clip-ratio": (shipped_config_values("gpt_ppo_actor", **{"model.ppo.ratio_eps": None}),
                        r"model\.ppo\.ratio_eps=null: this key needs a value"),
    "gae-lambda-above-one": (shipped_config_values("gpt_ppo_actor", **{"trainer.ppo.gae_lambda": 1.5}),
                             r"trainer\.ppo\.gae_lambda=1\.5 must be between 0 and 1"),
    "list-for-response-length": (shipped_config_values("gpt_grpo", **{"model.grpo.length_params.max_length": [1]}),
                                 r"model\.grpo\.length_params\.max_length=\[1\] must be an integer, got a list"),
    "port-out-of-range": (shipped_config_values("gpt_ppo_critic", **{"trainer.ppo.port": 70000}),
                          r"trainer\.ppo\.port=70000 must be a TCP port, 1-65535"),
    "zero-distillation-scale": (shipped_config_values("gpt_knowledge_distillation",
                                                      **{"model.knowledge_distillation.logits_scale": 0.0}),
                                r"model\.knowledge_distillation\.logits_scale=0\.0 must be > 0"),
    "nan-anywhere": (config_values(**{"model.data.train_ds.min_seq_length": float("nan")}),
                     r"model\.data\.train_ds\.min_seq_length=nan is not a number"),
    "unknown-recompute-granularity": (config_values(**{"model.activations_checkpoint_granularity": "some"}),
                                      r"model\.activations_checkpoint_granularity='some' must be one of full, "
                                      r"selective, null"),
    "text-for-bool": (value_shapes(**{"exp_manager.create_wandb_logger": "abc"}),
                      r"exp_manager\.create_wandb_logger='abc' must be true or false"),
    "list-for-bool": (value_shapes(**{"model.answer_only_loss": [True]}),
                      r"model\.answer_only_loss=\[True\] must be a single value \(like its default, True\), got a list"),
    "zero-size": (config_values(**{"model.global_batch_size": 0}), r"model\.global_batch_size=0 must be > 0"),
    "negative-size": (config_values(**{"model.num_layers": -2}), r"model\.num_layers=-2 must be > 0"),
    "negative-lr": (config_values(**{"model.optim.lr": -0.1}), r"model\.optim\.lr=-0\.1 must be >= 0"),
    "infinite-lr": (config_values(**{"model.optim.lr": float("inf")}), r"model\.optim\.lr=inf must be a finite number"),
    "nan-weight-decay": (config_values(**{"model.optim.weight_decay": float("nan")}),
                         r"model\.optim\.weight_decay=nan must be a finite number"),
    "adam-beta-of-one": (config_values(**{"model.optim.betas": [0.9, 1.0]}),
                         r"model\.optim\.betas=\[0\.9, 1\.0\] must be two numbers in \[0, 1\)"),
    "zero-adam-eps": (config_values(**{"model.optim.eps": 0.0}), r"model\.optim\.eps=0\.0 must be > 0"),
    "min-lr-above-lr": (schedule_values(**{"model.optim.lr": 5e-7}),
                        r"^model\.optim\.sched\.min_lr=9e-07 is above model\.optim\.lr=5e-07: CosineAnnealing decays "
                        r"from lr down to min_lr$"),
    "warm-up-steps-and-ratio": (schedule_values(**{"model.optim.sched.warmup_ratio": 0.05}),
                                r"^model\.optim\.sched\.warmup_steps=10 and model\.optim\.sched\.warmup_ratio=0\.05 "
                                r"are both set: NeMo takes one of them \(set warmup_steps=null to use the ratio\)$"),
    "no-training-batches": (config_values(**{"trainer.limit_train_batches": 0}),
                            r"trainer\.limit_train_batches=0 leaves no training batches"),
    "dropout-of-one": (config_values(**{"model.attention_dropout": 1.0}),
                       r"model\.attention_dropout=1\.0 must be < 1"),
    "server-sequence-multiple-as-a-list": (section_values("inference", strip_sequence_length_to_multiple=[1]),
                                           r"inference\.strip_sequence_length_to_multiple=\[1\] must be an integer, "
                                           r"got a list"),
    "server-log-file-as-a-list": (section_values("trainer.ppo", triton_log_file=[1]),
                                  r"trainer\.ppo\.triton_log_file=\[1\] must be one path, got a list"),
    # trainer.ppo.trt_llm.seed: ${model.seed} (comes first in the file): the message names model.seed
    "copied-value-named-at-its-source": (copied_value(), r"^model\.seed='abc' must be an integer, got str$"),
    "reward-head-dtype": (reward_model_with(force_head_dtype={"x": 1}),
                          r"^model\.force_head_dtype=\{'x': 1\} is not one of 32, bf16, 16$"),
    "beta-list-outside-spin": (section_values("model.dpo", ref_policy_kl_penalty=[0.1, 0.2]),
                               r"^model\.dpo\.ref_policy_kl_penalty=\[0\.1, 0\.2\] must be one number, got a list "
                               r"\(a list, one value per iteration, is for SPIN\)$"),
    "negative-init-std": (config_values(**{"model.init_method_std": -1}), r"^model\.init_method_std=-1 must be > 0$"),
    "sample-range-as-a-list": (section_values("", end_at_idx=[1]), r"^end_at_idx=\[1\] must be an integer, got a list$"),
    "group-size-null": (group_sampling(num_responses_per_prompt=None),
                        r"^model\.grpo\.num_responses_per_prompt=null: this key needs a value \(the group size\)$"),
    "rollout-micro-batch-null": (section_values("model.grpo", rollout_micro_batch_size=None),
                                 r"^model\.grpo\.rollout_micro_batch_size=null: this key needs a value$"),
    "rollout-prompts-null": (section_values("model.ppo", num_rollout_samples=None),
                             r"^model\.ppo\.num_rollout_samples=null: this key needs a value$"),
    "parallel-size-null": (config_values(**{"model.tensor_model_parallel_size": None}),
                           r"^model\.tensor_model_parallel_size=null: this key needs a value$"),
    "rope-scaling-as-a-dict": (config_values(**{"model.seq_len_interpolation_factor": {"x": 1}}),
                               r"^model\.seq_len_interpolation_factor=\{'x': 1\} must be a number, got a dict$"),
    "default-reward-null": (config_values(**{"model.data.default_rejected_reward": None}),
                           r"^model\.data\.default_rejected_reward=null: this key needs a value$"),
    "generate-length-null": (generate_config(**{"inference.tokens_to_generate": None}),
                             r"^inference\.tokens_to_generate=null: this key needs a value$"),
    "generate-batch-size-null": (generate_config(batch_size=None), r"^batch_size=null: this key needs a value$"),
    "kl-penalty-null": (shipped_config_values("gpt_grpo", **{"trainer.grpo.initial_policy_kl_penalty": None}),
                        r"^trainer\.grpo\.initial_policy_kl_penalty=null: this key needs a value$"),
    "dpo-beta-null": (shipped_config_values("gpt_dpo", **{"model.dpo.ref_policy_kl_penalty": None}),
                      r"^model\.dpo\.ref_policy_kl_penalty=null: this key needs a value$"),
    "regression-mask-value-null": (shipped_config_values("training_rm", **{"model.regression.loss_mask_val": None}),
                                   r"^model\.regression\.loss_mask_val=null: this key needs a value$"),
    "output-path-as-a-dict": (section_values("", output_path={"x": 1}),
                              r"^output_path=\{'x': 1\} must be one path, got a dict$"),
    "text-server-host": (text_server_bind(host="-5"), r"^host='-5' is not an address of this machine"),
    "text-server-port-taken": (text_server_bind(taken=True), r"^port=\d+ on 127\.0\.0\.1 is already in use"),
    "eval-web-server": (generate_config(web_server=True), r"^web_server=True is not supported: NeMo's Gradio web page"),
    "eval-split-rank": (generate_config(pipeline_model_parallel_split_rank=2),
                        r"^pipeline_model_parallel_split_rank=2 is not supported: it splits encoder-decoder models"),
    "eval-parallel-size-zero": (generate_config(tensor_model_parallel_size=0),
                                r"^tensor_model_parallel_size=0 must be > 0 \(or -1: keep model\.\*\)$"),
    "eval-micro-batch-zero": (generate_config(micro_batch_size=0),
                              r"^micro_batch_size=0 must be > 0 \(or -1: unused; prompts are generated batch_size "
                              r"at a time\)$"),
    "eval-parallel-sizes-disagree": (eval_parallel_sizes(tensor_model_parallel_size=2,
                                                         **{"model.tensor_model_parallel_size": 4}),
                                     r"^tensor_model_parallel_size=2 and model\.tensor_model_parallel_size=4 disagree; "
                                     r"set one of them$"),
    "negative-interval": (config_values(**{"trainer.sft.save_interval": -5}),
                          r"trainer\.sft\.save_interval=-5 must be >= 0"),
    "max-steps-not-an-integer": (config_values(**{"trainer.sft.max_steps": "abc"}),
                                 r"trainer\.sft\.max_steps='abc' must be an integer \(-1 or null: no limit\)"),
    "limit-batches-not-a-number": (config_values(**{"trainer.sft.limit_val_batches": "abc"}),
                                   r"trainer\.sft\.limit_val_batches='abc' must be a fraction"),
    "limit-batches-fraction-above-one": (config_values(**{"trainer.sft.limit_val_batches": 2.5}),
                                         r"trainer\.sft\.limit_val_batches=2\.5 must be a fraction between"),
    "tp-does-not-divide-query-groups": (parallel(2, 2, 1, 4, 3, 2),
                                        r"model\.tensor_model_parallel_size=2 does not divide model\.num_query_groups=3"),
    "pp-does-not-divide-layers": (parallel(2, 1, 2, 4, None, 3), r"model\.pipeline_model_parallel_size=2.*num_layers=3"),
    "world-not-divisible-by-tp-pp": (parallel(3, 2, 1, 4, None, 2), r"tensor_model_parallel_size=2"),
    "server-batch-below-micro-x-dp": (server_limits(),
                                      r"trainer\.ppo\.max_batch_size=8 is smaller than "
                                      r"trainer\.ppo\.inference_micro_batch_size=4 x data parallel size 4"),
    "missing-data-path": (missing_data_path(), r"model\.data\.data_prefix\.train is required"),
    "ppo-rollout-batch-below-critic-round": (rollout_batch_below_critic_round(),
                                             r"model\.ppo\.val_rollout_micro_batch_size=4 is smaller than the critic "
                                             r"server's trainer\.ppo\.inference_micro_batch_size x data parallel = 8 "
                                             r"\(127\.0\.0\.1:5567\)"),
    "sequence-parallel-actor": (sequence_parallel("actor"),
                                r"model\.sequence_parallel=True is not supported by MegatronGPTActorModel yet"),
    "sequence-parallel-reward-model": (sequence_parallel("reward"),
                                       r"model\.sequence_parallel=True is not supported by MegatronGPTRewardModel yet"),
    "sequence-parallel-generation": (sequence_parallel("generation"),
                                     r"model\.sequence_parallel=True is not supported for generation yet"),
}


@pytest.mark.parametrize("case", list(CONFIG_CASES))
def test_bad_config(workdir, case):
    fn, pattern = CONFIG_CASES[case]
    check(workdir, ConfigError, pattern, fn)


def test_every_shipped_config_passes_the_value_checks():
    from nemo_aligner.utils.config_checks import check_config_values

    from nemo_aligner.utils.config_keys import load_shipped

    conf = os.path.join(os.path.dirname(__file__), "..", "examples", "nlp", "gpt", "conf")
    names = sorted(name[:-5] for name in os.listdir(conf) if name.endswith(".yaml"))
    assert "gpt_sft" in names and "aligner_keys" not in names
    for name in names:
        check_config_values(load_shipped(name, conf))  # with NeMo-Aligner's keys (aligner_keys/) at their defaults


# ----------------------------------------------------------------- checkpoints
@pytest.fixture(scope="module")
def saved_nemo(tmp_path_factory, mcore_single):
    from nemo_aligner.models.nlp.gpt.gpt_sft_model import GPTSFTModel
    from nemo_aligner.utils.nemo_file import save_nemo

    cfg = OmegaConf.create(dict(TINY_ARCH, micro_batch_size=2, encoder_seq_length=32))
    return save_nemo(GPTSFTModel(cfg, ByteTokenizer()), str(tmp_path_factory.mktemp("nemo") / "model.nemo"))


def repack(src, dst, drop=None):
    with tarfile.open(src) as tin, tarfile.open(dst, "w") as tout:
        for member in tin.getmembers():
            if drop and member.name.lstrip("./") == drop:
                continue
            tout.addfile(member, tin.extractfile(member) if member.isfile() else None)
    return str(dst)


def test_nemo_without_model_config(workdir, saved_nemo):
    from nemo_aligner.utils.nemo_file import read_model_config

    broken = repack(saved_nemo, workdir / "no_config.nemo", drop="model_config.yaml")
    check(workdir, CheckpointError, r"model\.restore_from_path=.*no_config\.nemo: the archive has no model_config\.yaml",
          lambda: read_model_config(broken, "model.restore_from_path"))


MODEL_CONFIG_CASES = {
    "empty": ("", r"model_config\.yaml must hold the model's settings \(a YAML mapping\), got nothing"),
    "list": ("- num_layers\n- 2\n", r"model_config\.yaml must hold the model's settings \(a YAML mapping\), got list"),
    "invalid": ("num_layers: [2,\n", r"model_config\.yaml is not valid YAML \(line 2\)"),
}


@pytest.mark.parametrize("case", list(MODEL_CONFIG_CASES))
def test_nemo_with_a_bad_model_config(workdir, saved_nemo, case):
    text, pattern = MODEL_CONFIG_CASES[case]
    import io

    from nemo_aligner.utils.nemo_file import read_model_config

    broken = repack(saved_nemo, workdir / "bad_config.nemo", drop="model_config.yaml")
    with tarfile.open(broken, "a") as tar:
        info = tarfile.TarInfo("./model_config.yaml")
        info.size = len(text.encode())
        tar.addfile(info, io.BytesIO(text.encode()))
    check(workdir, CheckpointError, r"model\.restore_from_path=.*bad_config\.nemo: " + pattern,
          lambda: read_model_config(broken, "model.restore_from_path"))


def test_a_checkpoints_sizes_are_checked_before_the_run_reads_them(workdir, saved_nemo):
    """A run checks its parallel sizes against the checkpoint's heads and layers before starting: a
    list there (as a fuzzed model_config.yaml had) is one line naming the key and the checkpoint."""
    import io

    import yaml

    from nemo_aligner.utils.nemo_file import read_model_config
    from nemo_aligner.utils.run_setup import init_run

    config = dict(read_model_config(saved_nemo, "x"), num_attention_heads=[1])
    text = yaml.safe_dump(OmegaConf.to_container(OmegaConf.create(config))).encode()
    broken = repack(saved_nemo, workdir / "heads.nemo", drop="model_config.yaml")
    with tarfile.open(broken, "a") as tar:
        info = tarfile.TarInfo("./model_config.yaml")
        info.size = len(text)
        tar.addfile(info, io.BytesIO(text))
    cfg = OmegaConf.create({"trainer": {"devices": 1, "num_nodes": 1, "accelerator": "cpu", "precision": 32},
                            "model": {"micro_batch_size": 1, "global_batch_size": 1}})
    check(workdir, ConfigError, r"model\.num_attention_heads=\[1\] must be an integer, got a list \(when restoring, "
                                r"architecture values come from the checkpoint's model_config\.yaml\)",
          lambda: init_run(cfg, broken, "pretrained_checkpoint.restore_from_path"))


ARCHITECTURE_CASES = {
    "query-groups-not-dividing-heads": (dict(num_query_groups=3),
                                        r"model\.num_query_groups=3 must divide model\.num_attention_heads=4"),
    "learned-positions-shorter-than-the-sequence": (
        dict(max_position_embeddings=16, encoder_seq_length=32, position_embedding_type="learned_absolute"),
        r"model\.max_position_embeddings=16 is shorter than model\.encoder_seq_length=32"),
    "negative-ffn-size": (dict(ffn_hidden_size=-1), r"model\.ffn_hidden_size=-1 must be > 0 \(when restoring, "
                                                    r"architecture values come from the checkpoint's model_config\.yaml\)"),
    "text-for-hidden-size": (dict(hidden_size="abc"), r"model\.hidden_size='abc' must be an integer, got str"),
    "no-layer-count": (dict(num_layers=None), r"model\.num_layers=null: this key needs a value"),
    "a-list-for-the-norm-epsilon": (dict(layernorm_epsilon=[1]), r"model\.layernorm_epsilon=\[1\] must be a number"),
    "text-for-init-std": (dict(init_method_std="abc"), r"model\.init_method_std='abc' must be a number, got str"),
    "a-dict-for-the-padded-vocabulary": (dict(padded_vocab_size={"x": 1}),
                                         r"model\.padded_vocab_size=\{'x': 1\} must be an integer, got a dict"),
    "text-for-a-flag": (dict(share_embeddings_and_output_weights="false"),
                        r"model\.share_embeddings_and_output_weights='false' must be true or false, got str"),
    "rope-rotating-more-than-every-dimension": (dict(rotary_percentage=1.5), r"model\.rotary_percentage=1\.5 must be "
                                                                             r"between 0 and 1"),
}


@pytest.mark.parametrize("case", list(ARCHITECTURE_CASES))
def test_architecture_values_that_cannot_build_a_model_are_refused(case):
    from nemo_aligner.models.nlp.gpt.gpt_builder import transformer_config_from_cfg

    extra, pattern = ARCHITECTURE_CASES[case]
    with pytest.raises(ConfigError, match=pattern):
        transformer_config_from_cfg(OmegaConf.create(dict(TINY_ARCH, **extra)))


def test_a_bad_checkpoint_value_the_run_leaves_null_is_named_as_the_checkpoints():
    """Keys the checkpoint decides unless the run sets them (``attention_dropout: null``): a bad value
    in model_config.yaml is refused as the checkpoint's; a run value replaces it without complaint."""
    from nemo_aligner.utils.model_config import merge_checkpoint_config

    ckpt = OmegaConf.create(dict(TINY_ARCH, attention_dropout={"x": 1}, encoder_seq_length=32))
    with pytest.raises(ConfigError, match=r"^model\.attention_dropout=\{'x': 1\} must be a number, got a dict \(the "
                                          r"checkpoint's model_config\.yaml value: set model\.attention_dropout to "
                                          r"override it\)$"):
        merge_checkpoint_config(ckpt, OmegaConf.create({"attention_dropout": None}))
    merged = merge_checkpoint_config(ckpt, OmegaConf.create({"attention_dropout": 0.1}))
    assert merged.attention_dropout == 0.1 and merged.encoder_seq_length == 32


def test_nemo_that_is_not_a_tar(workdir):
    from nemo_aligner.utils.nemo_file import check_exists

    path = write(workdir, "random.nemo", data=os.urandom(4096))
    check(workdir, CheckpointError, r"model\.restore_from_path=.*random\.nemo: not a \.nemo file",
          lambda: check_exists(path, "model.restore_from_path"))


def test_nemo2_checkpoint_directory(workdir):
    from nemo_aligner.utils.nemo_file import check_exists

    os.makedirs(workdir / "nemo2" / "context")
    os.makedirs(workdir / "nemo2" / "weights")
    write(workdir, "nemo2/context/model.yaml", text="_target_: nemo.collections.llm.gpt.model.llama.LlamaModel\n")
    check(workdir, CheckpointError, r"model\.restore_from_path=.*nemo2: a NeMo 2\.0 checkpoint \(context/, weights/\); "
          r"NeMo-Aligner's scripts, like these, read NeMo 1\.x \.nemo files",
          lambda: check_exists(str(workdir / "nemo2"), "model.restore_from_path"))


def test_nemo_from_a_different_architecture(workdir, mcore_single):
    """GPT-2-style weights (learned positions, LayerNorm with biases) into a Llama-style model."""
    from nemo_aligner.models.nlp.gpt.gpt_sft_model import GPTSFTModel
    from nemo_aligner.utils import nemo_file

    gpt2 = GPTSFTModel(OmegaConf.create(dict(TINY_GPT2_ARCH, micro_batch_size=2, encoder_seq_length=32)), ByteTokenizer())
    path = nemo_file.save_nemo(gpt2, str(workdir / "gpt2.nemo"))
    other = GPTSFTModel(OmegaConf.create(dict(TINY_ARCH, micro_batch_size=2, encoder_seq_length=32)), ByteTokenizer())
    before = snapshot(workdir)
    with nemo_file.extracted(path) as directory:
        with pytest.raises(CheckpointError, match=r"model\.restore_from_path=.*gpt2\.nemo .*has shape .* in the "
                                                  r"checkpoint but .* in the model built from the config"):
            other.load_weights(nemo_file.weights_dir(directory), what=f"model.restore_from_path={path}")
    assert snapshot(workdir) == before


HOST_CASES = {
    "unresolvable": ("no-such-host.invalid", r"inference\.host='no-such-host\.invalid' is not an address of this machine"),
    "another-machine": ("192.0.2.1", r"inference\.host='192\.0\.2\.1' is not an address of this machine"),  # TEST-NET-1
}


@pytest.mark.parametrize("case", list(HOST_CASES))
def test_a_server_host_that_is_not_this_machines_is_named(case):
    host, pattern = HOST_CASES[case]
    from nemo_aligner.servers.triton_host import ServerAddress, check_ports_free
    from nemo_aligner.utils.ports import free_port

    with pytest.raises(ConfigError, match=pattern):
        check_ports_free(ServerAddress(host, free_port(), free_port(), free_port()), "inference")


def test_the_catalogue_doc_is_generated_from_the_tests():
    import subprocess
    import sys

    script = os.path.join(os.path.dirname(__file__), "reliability", "catalogue.py")
    generated = subprocess.run([sys.executable, script], capture_output=True, text=True, check=True).stdout
    with open(os.path.join(os.path.dirname(__file__), "..", "docs", "reliability_catalogue.md"), encoding="utf-8") as f:
        assert f.read() == generated, "docs/reliability_catalogue.md is stale: python tests/reliability/catalogue.py --write"


@pytest.mark.parametrize("damage", ["missing", "empty", "garbage", "cut"])
def test_nemo_with_a_damaged_checkpoint_index(workdir, saved_nemo, damage):
    """model_weights/.metadata (torch's checkpoint index, a pickle) missing, empty, overwritten or cut short."""
    import io

    from nemo_aligner.utils import nemo_file
    from nemo_aligner.utils.checkpoint_io import checkpoint_shapes

    broken = repack(saved_nemo, workdir / "damaged.nemo", drop="model_weights/.metadata")
    if damage != "missing":
        with tarfile.open(saved_nemo) as tar:
            good = tar.extractfile("./model_weights/.metadata").read()
        data = {"empty": b"", "garbage": os.urandom(len(good)), "cut": good[: len(good) // 2]}[damage]
        with tarfile.open(broken, "a") as tar:
            info = tarfile.TarInfo("./model_weights/.metadata")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    with nemo_file.extracted(broken) as directory:
        check(workdir, CheckpointError, r"model\.restore_from_path=.*damaged\.nemo .*model_weights: its index "
                                        r"\(\.metadata\) cannot be read \(.+\); the checkpoint is damaged or incomplete",
              lambda: checkpoint_shapes(nemo_file.weights_dir(directory), f"model.restore_from_path={broken}"))


def test_checkpoint_with_a_damaged_common_file(workdir, saved_nemo):
    from nemo_aligner.utils import nemo_file
    from nemo_aligner.utils.checkpoint_io import load_common

    with nemo_file.extracted(saved_nemo) as directory:
        weights = nemo_file.weights_dir(directory)
        with open(os.path.join(weights, "common.pt"), "wb") as f:
            f.write(os.urandom(512))
        check(workdir, CheckpointError, r"checkpoint .*model_weights: common\.pt cannot be read \(.+\); the checkpoint "
                                        r"is damaged or incomplete", lambda: load_common(weights))
