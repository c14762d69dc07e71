"""Constitutional AI: the text generation server (NeMo's REST protocol), the SL-CAI and RL-CAI data
scripts against it, and the training stages they feed, on the built-in tiny model (docs/cai.md)."""

import json
import os
import signal
import subprocess
import sys

import pytest

from conftest import REPO, SCRIPTS, WORKERS, free_port, read_metrics, run_python, run_script, subprocess_env
from nemo_aligner.recipes import cai
from nemo_aligner.servers.text_generation_server import RequestError, parse_request
from nemo_aligner.utils.errors import DataError

CAI = os.path.join(REPO, "examples", "nlp", "cai")
TEMPLATE = ["--user_format", "{MESSAGE} ", "--assistant_format", "{MESSAGE}\\n", "--system_format", "{MESSAGE}\\n",
            "--eos_token", "", "--response_extract_pattern", "", "--end_strings", "--tokens_to_generate", "8"]


def test_chat_template_and_judge_parsing():
    t = cai.ChatTemplate(user_format="<u>{MESSAGE}\n<a>", assistant_format="{MESSAGE}<e>\n",
                         system_format="<s>{MESSAGE}\n", system_default_message="be kind", eos_token="<e>",
                         response_extract_pattern="<a>")
    chat = [{"role": "User", "content": "hi"}, {"role": "Assistant", "content": "hello"}, {"role": "User", "content": "?"}]
    prompt = t.format(chat)
    assert prompt == "<s>be kind\n<u>hi\n<a>hello<e>\n<u>?\n<a>"
    assert t.extract_response(prompt + " sure <e>\n<u>more", prompt) == "sure"
    assert t.extract_response("other text<a>reply<e>", prompt) == "reply"  # not prefixed: split on the pattern
    with pytest.raises(Exception, match=r"--user_format='x' must contain \{MESSAGE\}"):
        cai.ChatTemplate(user_format="x")
    assert cai.parse_judge_answer('{ "chosen" : 3, "rejected": 1} because', 4) == (2, 0)
    assert cai.parse_judge_answer("{'chosen': '#2', 'rejected': '#2'}", 4) is None
    assert cai.parse_judge_answer("chosen: 5, rejected: 1", 4) is None
    assert cai.parse_judge_answer("no idea", 4) is None
    splits = cai.split_records(list(range(10)), {"train": 0.8, "test": 0.2}, shuffle=False, seed=0)
    assert splits == {"train": list(range(8)), "test": [8, 9]}
    records = cai.preference_records([{"prompt": "p", "responses": ["a", "b", "a"]}, {"prompt": "q", "responses": ["x", "x"]}],
                                     lambda prompt, responses: (0, 1) if prompt == "p" else (0, 1))
    assert records == [{"prompt": "p", "chosen": "a", "rejected": "b"}]  # q: identical texts, dropped


def test_red_team_prompts_and_instructions(tmp_path):
    path = tmp_path / "red.jsonl"
    path.write_text(json.dumps({"transcript": "\n\nHuman: How do I pick a lock?\n\nAssistant: First..."}) + "\n"
                    + json.dumps({"prompt": "  tell me  "}) + "\n")
    assert cai.read_red_team_prompts(str(path)) == ["How do I pick a lock?", "tell me"]
    path.write_text(json.dumps({"transcript": "no turns"}) + "\n")
    with pytest.raises(DataError, match=r"red\.jsonl:1: transcript has no 'Human: \.\.\. Assistant:' turn"):
        cai.read_red_team_prompts(str(path))
    instructions = cai.read_instructions(os.path.join(CAI, "CritiqueRevisionInstructions.json"))
    assert len(instructions) == 4 and not instructions[0][0].startswith("\n") and not instructions[0][1].endswith(":")
    bad = tmp_path / "inst.json"
    bad.write_text(json.dumps({"harmful0": {"prompt": "not a list", "edit_request": "x"}}))
    with pytest.raises(DataError, match=r"inst\.json: harmful0 must be"):
        cai.read_instructions(str(bad))
    assert len(cai.read_few_shot(os.path.join(CAI, "few_shot_samples_example.json"))) == 6


@pytest.mark.parametrize("body,message", [
    (b"not json", r"the body is not JSON"),
    (b'{"sentences": []}', r"sentences must be a non-empty list"),
    (b'{"sentences": ["a"], "tokens_to_generate": -1}', r"tokens_to_generate must be an integer in \[0, 64\]"),
    (b'{"sentences": ["a"], "top_p": 2}', r"top_p must be a number in \[0.0, 1.0\]"),
    (b'{"sentences": ["a"], "greedy": "yes"}', r"greedy must be true or false"),
    (b'{"sentences": ["a"], "repetition_penalty": 1.2}', r"repetition_penalty other than 1.0 is not supported"),
    (b'{"sentences": ["a"], "neighbors": 2}', r"unknown field 'neighbors'"),
    (b'{"sentences": ["a"], "min_tokens_to_generate": 9, "tokens_to_generate": 8}', r"min_tokens_to_generate is larger"),
    (b'{"sentences": ["ok", "a\\ud800"]}', r"sentences\[1\] is not valid Unicode text \(a lone surrogate at character 1\)"),
    (b'{"sentences": ["a"], "end_strings": ["\\udfff"]}', r"end_strings\[0\] is not valid Unicode text"),
], ids=["json", "empty", "negative", "top-p", "greedy-type", "repetition", "unknown", "min-max", "surrogate",
        "surrogate-end"])
def test_generation_requests_are_checked(body, message):
    with pytest.raises(RequestError, match=message):
        parse_request(body, max_tokens=64)
    ok = parse_request(b'{"sentences": "one", "top_p": 0.0, "end_strings": "<e>"}', 64)
    assert ok["sentences"] == ["one"] and ok["end_strings"] == ["<e>"] and ok["tokens_to_generate"] == 64


def test_megatron_gpt_eval_parallel_keys_set_the_layout():
    """NeMo's megatron_gpt_eval.py keys (the tutorials' serving command) on generate_gpt.py."""
    from omegaconf import OmegaConf

    from nemo_aligner.recipes.generate import apply_eval_parallel_sizes

    cfg = OmegaConf.load(os.path.join(SCRIPTS, "conf", "gpt_generate.yaml"))
    apply_eval_parallel_sizes(cfg)  # -1: model.* as it is
    assert (cfg.model.tensor_model_parallel_size, cfg.model.pipeline_model_parallel_size) == (1, 1)
    cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size = 8, 2
    apply_eval_parallel_sizes(cfg)
    assert (cfg.model.tensor_model_parallel_size, cfg.model.pipeline_model_parallel_size) == (8, 2)


def _server(model: str, port: int, log):
    # NeMo-Aligner's tutorial command for NeMo's megatron_gpt_eval.py, with this script's path
    cmd = [sys.executable, os.path.join(SCRIPTS, "generate_gpt.py"), f"gpt_model_file={model}",
           "pipeline_model_parallel_split_rank=0", "server=True", "tensor_model_parallel_size=1",
           "pipeline_model_parallel_size=1", "trainer.precision=32", "trainer.devices=1", "trainer.num_nodes=1",
           f"port={port}", "web_server=False", "++model.encoder_seq_length=256"]
    return subprocess.Popen(cmd, env=subprocess_env(), stdout=log, stderr=subprocess.STDOUT, cwd=SCRIPTS)


def test_cai_pipeline_on_the_builtin_task(tmp_path, quick_sft, builtin_data):
    """Server -> SL-CAI records -> SFT on them -> RL-CAI preferences -> DPO (docs/cai.md runs RM + PPO too)."""
    from nemo_aligner.servers.clients import TextGenerationClient, check_reachable

    port = free_port()
    log = open(tmp_path / "server.log", "w")
    server = _server(quick_sft, port, log)
    try:
        check_reachable("127.0.0.1", port, "port", wait_s=120)
        client = TextGenerationClient("127.0.0.1", port)
        reply = client.request(["reverse abc = "], tokens_to_generate=4, greedy=True, compute_logprob=True)
        assert reply["sentences"][0].startswith("reverse abc = ") and len(reply["logprob"][0]) > 10
        with pytest.raises(Exception, match=r"HTTP 400\): sentence 0 has \d+ tokens; with tokens_to_generate=250"):
            client.request(["x" * 40], tokens_to_generate=250)

        sl = tmp_path / "sl" / "sl_cai.jsonl"
        proc = run_python(os.path.join(CAI, "generate_sl_cai_dataset.py"), [
            "--red-teaming-prompts-dataset-path", builtin_data["prompts_val"], "--num-examples", "8",
            "--critique-revision-instructions-path", os.path.join(CAI, "builtin_task", "CritiqueRevisionInstructions.json"),
            "--helpfulness-dataset-path", builtin_data["chat_val"], "--output-filepath", str(sl),
            "--port", str(port), "--batch_size", "4", *TEMPLATE])
        assert "SL-CAI: " in proc.stdout
        raw = json.loads((tmp_path / "sl" / "cai_output" / "cai_critique_revision_samples.json").read_text())
        assert len(raw) == 8 and all(r["critique_prompt"] in ("is it right?", "check it:") for r in raw)
        records = [json.loads(line) for line in sl.read_text().splitlines()]
        assert len(records) > 64 and sum(r.get("dataset") == "sl_cai_samples" for r in records) >= 4

        rl = tmp_path / "rl"
        proc = run_python(os.path.join(CAI, "generate_rl_cai_dataset.py"), [
            "--batch-size", "8", "--red-teaming-file-path", builtin_data["prompts_val"], "--num-examples", "24",
            "--sys-prompt-constitution-file-path", os.path.join(CAI, "builtin_task", "sys_prompt_constitution"),
            "--output-dir", str(rl), "--output-filename-prefix", "cai", "--port", str(port), *TEMPLATE])
        assert "AI preferences" in proc.stdout
        duplicate = run_python(os.path.join(CAI, "generate_rl_cai_dataset.py"), [
            "--batch-size", "8", "--red-teaming-file-path", builtin_data["prompts_val"], "--num-examples", "8",
            "--sys-prompt-constitution-file-path", os.path.join(CAI, "builtin_task", "sys_prompt_constitution"),
            "--output-dir", str(rl), "--output-filename-prefix", "cai", "--port", str(port), *TEMPLATE], check=False)
        assert duplicate.returncode == 1 and "already exists" in duplicate.stderr and "Traceback" not in duplicate.stderr
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()
    assert server.returncode == 0, (tmp_path / "server.log").read_text()[-2000:]

    comparisons = [json.loads(line)["text"] for line in
                   (rl / "cai_train_comparisons_with_chat_prompt.jsonl").read_text().splitlines()]
    assert len(comparisons) >= 4 and len(comparisons) % 2 == 0
    dpo = [json.loads(line) for line in (rl / "cai_train_dpo_with_chat_prompt.jsonl").read_text().splitlines()]
    # the reward model's pairs are the DPO pairs' full texts (the RM and PPO stages read them as usual)
    assert comparisons[:2] == [dpo[0]["prompt"] + dpo[0]["chosen_response"], dpo[0]["prompt"] + dpo[0]["rejected_response"]]
    run_script("train_gpt_sft.py", [
        f"model.restore_from_path={quick_sft}", f"model.data.train_ds.file_path={sl}",
        f"model.data.validation_ds.file_path={sl}", "model.data.chat=True", "trainer.sft.max_steps=2",
        "model.data.train_ds.global_batch_size=8", "model.data.train_ds.micro_batch_size=4",
        f"exp_manager.explicit_log_dir={tmp_path / 'sft'}"])
    run_script("train_gpt_dpo.py", [
        f"pretrained_checkpoint.restore_from_path={quick_sft}",
        f"++model.data.data_prefix={{train: [{rl / 'cai_train_dpo_with_chat_prompt.jsonl'}]}}",
        "trainer.dpo.max_steps=2", "model.global_batch_size=2", "model.micro_batch_size=1",
        f"exp_manager.explicit_log_dir={tmp_path / 'dpo'}"])
    for stage, key in (("sft", "train/loss"), ("dpo", "train/loss")):
        assert [r["step"] for r in read_metrics(tmp_path / stage) if key in r] == [1, 2], stage


def test_text_server_refuses_a_bad_host_before_loading(quick_sft):
    proc = subprocess.run([sys.executable, os.path.join(SCRIPTS, "generate_gpt.py"), f"gpt_model_file={quick_sft}",
                           "server=True", "host=-5", f"port={free_port()}"], env=subprocess_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "error: host='-5' is not an address of this machine" in proc.stderr


def test_null_sampling_settings_are_the_defaults(tmp_path, quick_sft):
    """``generate_gpt.py`` with ``inference.temperature/top_k/top_p=null`` samples as with their defaults
    (1.0, 0, 1.0), as the models' ``sampling_params`` read null."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("reverse abc = ", "sort cba = ")))
    outputs = []
    for values in (("null", "null", "null"), ("1.0", "0", "1.0")):
        out = tmp_path / f"out{len(outputs)}.jsonl"
        run_script("generate_gpt.py", [
            f"gpt_model_file={quick_sft}", f"prompts_file={prompts}", f"output_file={out}", "inference.greedy=False",
            "inference.seed=3", "inference.tokens_to_generate=8",
            *(f"inference.{key}={value}" for key, value in zip(("temperature", "top_k", "top_p"), values))])
        outputs.append(out.read_text())
    assert outputs[0] == outputs[1] and outputs[0].count("\n") == 2


@pytest.mark.parametrize("start", ["restored", "from-scratch"])
def test_megatron_gpt_eval_reads_a_training_checkpoint(tmp_path, builtin_data, base_nemo, start):
    """NeMo's checkpoint_dir/checkpoint_name(/hparams_file) source: the step-4 checkpoint of an SFT run
    (started from a .nemo, or from scratch with the config's architecture) generates exactly what the
    .nemo the run wrote at step 4 generates (sampled, seeded: any weight or tokenizer difference shows)."""
    log_dir = tmp_path / "sft"
    restore = [f"model.restore_from_path={base_nemo[0]}"] if start == "restored" else []
    run_script("train_gpt_sft.py", restore + [
        f"model.data.train_ds.file_path={builtin_data['sft_train']}",
        f"model.data.validation_ds.file_path={builtin_data['sft_val']}", f"exp_manager.explicit_log_dir={log_dir}",
        "trainer.sft.max_steps=4", "trainer.sft.val_check_interval=2", "trainer.sft.limit_val_batches=1",
        "model.data.train_ds.global_batch_size=8", "model.data.train_ds.micro_batch_size=4",
        "model.optim.lr=1e-2", "model.optim.sched.warmup_steps=0", "model.optim.sched.constant_steps=0",
        "model.optim.sched.min_lr=1e-3", "exp_manager.checkpoint_callback_params.save_top_k=-1"])
    ckpts = log_dir / "checkpoints"
    step4 = next(c for c in os.listdir(ckpts) if "-step=4-" in c and not c.endswith(".nemo"))
    sampled = ["prompts=['sort cba = ','reverse abc = ']", "inference.greedy=False", "inference.temperature=1.0",
               "inference.top_k=0", "inference.seed=5", "inference.tokens_to_generate=6"]
    outs = {}
    for name, source in (("nemo", [f"gpt_model_file={ckpts / 'megatron_gpt_sft.nemo'}"]),
                         ("checkpoint", [f"checkpoint_dir={ckpts}", f"checkpoint_name='{step4}'"])):
        out = tmp_path / f"{name}.jsonl"
        run_script("generate_gpt.py", source + sampled + [f"output_file={out}"])
        outs[name] = [json.loads(line)["response"] for line in out.read_text().splitlines()]
    assert outs["checkpoint"] == outs["nemo"] and len(outs["nemo"]) == 2, outs
    # an explicit hparams_file, and a checkpoint of another step (2), load too
    step2 = next(c for c in os.listdir(ckpts) if "-step=2-" in c and not c.endswith(".nemo"))
    proc = run_script("generate_gpt.py", [f"checkpoint_dir={ckpts}", f"checkpoint_name='{step2}'",
                                          f"hparams_file={log_dir / 'hparams.yaml'}", *sampled])
    assert proc.stdout.count('"response"') == 2


@pytest.mark.stack
def test_megatron_gpt_eval_reads_a_training_checkpoint_nemo_wrote(tmp_path, base_nemo):
    """A checkpoint NeMo(-Aligner) wrote (Transformer Engine names, optimizer tensors beside the
    model's, Lightning's common.pt with the model config as OmegaConf objects), named as NeMo logs it
    (``<name>.ckpt``), generates what a .nemo of the same weights generates, with the run's hparams.yaml
    or, without it, the config Lightning saved in the checkpoint; a common.pt holding an object the safe
    loader does not read is one line naming its type."""
    import pathlib

    import torch

    nemo, _ = base_nemo
    ckpts = tmp_path / "megatron_gpt_sft" / "checkpoints"
    name = "megatron_gpt_sft--validation_loss=1.500-step=4-consumed_samples=32.0-epoch=0-last"
    same = tmp_path / "same.nemo"
    run_python(os.path.join(WORKERS, "nemo_training_checkpoint.py"), [
        "--nemo", str(nemo), "--perturb", "--te", "--scheduler-steps", "4", "--out", str(ckpts / name),
        "--save-nemo", str(same)])
    # NeMo-Aligner's hparams.yaml: the whole run config, the model's starting .nemo under model.
    (ckpts.parent / "hparams.yaml").write_text(f"name: megatron_gpt_sft\nmodel:\n  restore_from_path: {nemo}\n"
                                               "  megatron_amp_O2: true\n")
    sampled = ["prompts=['sort cba = ','reverse abc = ']", "inference.greedy=False", "inference.temperature=1.0",
               "inference.top_k=0", "inference.seed=5", "inference.tokens_to_generate=6"]
    outs = {}
    for label, source in (("nemo", [f"gpt_model_file={same}"]),
                          ("checkpoint", [f"checkpoint_dir={ckpts}", f"checkpoint_name='{name}.ckpt'"]),
                          ("base", [f"gpt_model_file={nemo}"])):
        out = tmp_path / f"{label}.jsonl"
        run_script("generate_gpt.py", source + sampled + [f"output_file={out}"])
        outs[label] = [json.loads(line)["response"] for line in out.read_text().splitlines()]
    assert outs["checkpoint"] == outs["nemo"] and len(outs["nemo"]) == 2, outs
    assert outs["base"] != outs["nemo"]  # the checkpoint's weights, not the run's starting ones
    # without hparams.yaml, as NeMo's load_from_checkpoint: the model config saved in the checkpoint
    os.remove(ckpts.parent / "hparams.yaml")
    out = tmp_path / "saved_config.jsonl"
    run_script("generate_gpt.py", [f"checkpoint_dir={ckpts}", f"checkpoint_name='{name}'", *sampled,
                                   f"output_file={out}"])
    assert [json.loads(line)["response"] for line in out.read_text().splitlines()] == outs["nemo"]
    torch.save({"hyper_parameters": {"log_dir": pathlib.PurePosixPath("/results")}}, ckpts / name / "common.pt")
    proc = run_script("generate_gpt.py", [f"checkpoint_dir={ckpts}", f"checkpoint_name='{name}'", *sampled],
                      check=False)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode != 0 and len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert f"{name}: holds a pathlib.PurePosixPath object beside its tensors, which is not unpickled" in errors[0]


def test_training_checkpoint_sources_that_cannot_load_are_one_line(tmp_path):
    from omegaconf import OmegaConf

    from nemo_aligner.recipes.generate import generation_source
    from nemo_aligner.utils.errors import ConfigError

    ckpts = tmp_path / "run" / "checkpoints"
    (ckpts / "step=2").mkdir(parents=True)
    hparams = tmp_path / "run" / "hparams.yaml"

    def source(**keys):
        return generation_source(OmegaConf.create({"gpt_model_file": None, **keys}))

    for keys, message in (
            ({"checkpoint_dir": str(ckpts)}, r"checkpoint_dir=.* and checkpoint_name=None: give both"),
            ({"checkpoint_dir": str(ckpts), "checkpoint_name": "step=9"}, r"step=9: not a checkpoint directory"),
            ({"checkpoint_dir": str(ckpts), "checkpoint_name": "step=2"},
             r"hparams_file=.*run/hparams\.yaml: no such file \(the hparams\.yaml a training run writes")):
        with pytest.raises(ConfigError, match=message):
            source(**keys)
    for text, message in (
            ("model: [1, 2]\n", r"has no model section"),
            ("model:\n  restore_from_path: /gone/base.nemo\n",
             r"model\.restore_from_path=/gone/base\.nemo, the \.nemo the run started from, does not exist"),
            ("model:\n  peft:\n    peft_scheme: lora\n", r"a lora run's checkpoint is not read here \(its adapters would be left out\)")):
        hparams.write_text(text)
        with pytest.raises(ConfigError, match=message):
            source(checkpoint_dir=str(ckpts), checkpoint_name="step=2")
    hparams.write_text("cfg:\n  num_layers: 2\n")  # NeMo's hparams.yaml: the model config under cfg
    assert source(checkpoint_dir=str(ckpts), checkpoint_name="step=2").base is None
    with pytest.raises(ConfigError, match=r"gpt_model_file=m\.nemo and checkpoint_dir=.*: give one of them"):
        generation_source(OmegaConf.create({"gpt_model_file": "m.nemo", "checkpoint_dir": str(ckpts)}))


def test_megatron_gpt_eval_keys_parse_and_its_absent_features_are_refused(tmp_path, quick_sft):
    """Every key of NeMo's megatron_gpt_inference.yaml parses at its default (the web page's settings
    and the top-level micro_batch_size name themselves as changing nothing); a training checkpoint
    (checkpoint_dir) beside gpt_model_file and the chat web page are one error line."""
    nemo_defaults = ["micro_batch_size=-1", "expert_model_parallel_size=-1", "tensor_model_parallel_size=-1",
                     "pipeline_model_parallel_size=-1", "pipeline_model_parallel_split_rank=-1", "megatron_amp_O2=False",
                     "checkpoint_dir=null", "checkpoint_name=null", "hparams_file=null", "server=False", "port=5555",
                     "web_server=False", "share=False", "username=test", "password=test2", "web_port=9889",
                     "chat=False", "chatbot_config.value=False", "chatbot_config.user=User",
                     "trainer.logger=False", "trainer.use_distributed_sampler=False"]
    out = tmp_path / "out.jsonl"
    proc = run_script("generate_gpt.py", [f"gpt_model_file={quick_sft}", "prompts=['sort cba = ']", f"output_file={out}",
                                          "inference.tokens_to_generate=4", *nemo_defaults])
    assert [json.loads(line)["prompt"] for line in out.read_text().splitlines()] == ["sort cba = "]
    text = proc.stdout + proc.stderr
    for key in ("micro_batch_size", "share", "web_port", "chatbot_config.user"):
        assert f"{key} is accepted for NeMo-Aligner's commands but changes nothing here" in text, key
    for bad, message in (("checkpoint_dir=/ckpts", f"error: gpt_model_file={quick_sft} and checkpoint_dir=/ckpts: give "
                                                   "one of them"),
                         ("chat=True", "error: chat=True: NeMo's chat web page is not available")):
        proc = run_script("generate_gpt.py", [f"gpt_model_file={quick_sft}", "prompts=['x']", bad], check=False)
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
        assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
        assert len(errors) == 1 and errors[0].startswith(message), errors
