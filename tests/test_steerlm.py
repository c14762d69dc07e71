"""SteerLM: labels and prompts, annotation by a regression reward-model server, and steering a
model trained on the built-in task by the attribute value in its prompt."""

import json
import os
import subprocess
import sys

import pytest
import torch
from omegaconf import OmegaConf

from conftest import REPO, TINY_ARCH, ServerProcess, free_port, run_script, subprocess_env
from nemo_aligner.data.nlp.sft_dataset import GPTSFTChatDataset
from nemo_aligner.data.nlp.steerlm_annotate import values_to_label
from nemo_aligner.data.nlp.steerlm_labels import (assistant_turn_texts, format_label, parse_label, render_turns,
                                                  steer_prompt)
from nemo_aligner.utils.errors import DataError
from nemo_aligner.utils.tokenizers import ByteTokenizer

CHAT = {"system": "be brief", "mask": "User", "type": "VALUE_TO_TEXT", "conversations": [
    {"from": "User", "value": "reverse abc ="}, {"from": "Assistant", "value": "cba", "label": "quality:4,verbosity:1"},
    {"from": "User", "value": "sort cab ="}, {"from": "Assistant", "value": "abc"}]}


def test_labels_round_trip_and_errors():
    assert format_label({"quality": 4.0, "humor": 0.5}) == "quality:4,humor:0.5"
    assert format_label([3, 1], ["quality", "verbosity"]) == "quality:3,verbosity:1"
    assert parse_label("quality:4, verbosity:1") == {"quality": 4.0, "verbosity": 1.0}
    with pytest.raises(DataError, match=r"f\.jsonl:2: conversations\[1\]\.label: attribute 'quality=4'"):
        parse_label("quality=4", "f.jsonl:2: conversations[1].label")
    assert values_to_label([4.6, -0.7, 2.5, 1.49], ["a", "b", "c", "d"], 0, 4) == "a:4,b:0,c:2,d:1"  # half to even


def test_steer_prompt_is_the_training_prefix():
    """The inference prompt equals the text SFT trained on, up to where the response starts."""
    tok = ByteTokenizer()
    ds = GPTSFTChatDataset("x.jsonl", tok, 256, records=[dict(CHAT, __line__=1)])
    rendered = ds.render(CHAT)
    prompt = steer_prompt(CHAT["conversations"][:1], "quality:4,verbosity:1", system="be brief")
    assert rendered.startswith(prompt) and rendered[len(prompt):].startswith("cba\n")
    assert steer_prompt("reverse abc =", {"quality": 4}) == "\x00System\n\n\x11User\nreverse abc =\n\x11Assistant\n\x12quality:4\n"
    texts = assistant_turn_texts(CHAT)
    assert [i for i, _ in texts] == [1, 3]
    assert texts[0][1] == render_turns("be brief", CHAT["conversations"][:2], with_labels=False)
    assert "\x12" not in texts[1][1] and texts[1][1].endswith("\x11Assistant\nabc\n")


def test_attribute_annotate_labels_from_the_server(tmp_path, mcore_single):
    """attribute_annotate.py writes, for every Assistant turn, the server's rounded and clipped
    attribute values for that turn's conversation prefix."""
    from nemo_aligner.models.nlp.gpt.megatron_gpt_reward_model import MegatronGPTRewardModel
    from nemo_aligner.utils.nemo_file import save_nemo

    torch.manual_seed(5)
    cfg = OmegaConf.create(dict(TINY_ARCH, micro_batch_size=2, encoder_seq_length=64, reward_model_type="regression",
                                regression={"num_attributes": 2, "attribute_names": ["quality", "verbosity"]}))
    model = MegatronGPTRewardModel(cfg, ByteTokenizer(), trainable=False)
    records = [CHAT, {"conversations": [{"from": "User", "value": "sort dcba ="}, {"from": "Assistant", "value": "abcd"}]},
               {"conversations": [{"from": "User", "value": "reverse xy ="}, {"from": "Assistant", "value": "yxz"}]}]
    source = tmp_path / "chat.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in records))
    model.prepare_for_inference()

    def local_values():
        out = []
        for record in records:
            for _, text in assistant_turn_texts(record):
                ids = model.tokenizer.text_to_ids(text) + [model.tokenizer.eos_id]
                out.append(model.infer(torch.tensor([ids]), torch.tensor([len(ids)]))[0])
        return torch.stack(out)

    head = model.module.rm_head
    raw = local_values().to(head.bias.device)
    with torch.no_grad():  # an affine change of the head spreads the outputs over about -1..5, so that
        # rounding and clipping at both ends matter
        scale = 6.0 / (raw.max(0).values - raw.min(0).values)
        head.bias.copy_(2.0 - scale * (raw.mean(0) - head.bias))
        head.weight.mul_(scale.unsqueeze(1))
    values = local_values()
    expected = [values_to_label(v.tolist(), ["quality", "verbosity"], 0, 4) for v in values]
    nemo = save_nemo(model, str(tmp_path / "rm.nemo"))
    assert len(set(expected)) > 1, expected  # the check below is not trivially constant

    server = ServerProcess(tmp_path, "serve_reward_model.py", "reward model server ready")
    server.start([f"rm_model_file={nemo}", f"inference.port={server.port}", f"inference.grpc_port={free_port()}",
                  f"inference.metrics_port={free_port()}", f"inference.workspace_dir={server.workspace}"])
    with server:
        out = tmp_path / "labelled.jsonl"
        script = os.path.join(REPO, "examples", "nlp", "data", "steerlm", "attribute_annotate.py")
        run = subprocess.run([sys.executable, script, "--input-file", str(source), "--output-file", str(out),
                              "--port", str(server.port), "--attributes", "quality,verbosity"],
                             env=subprocess_env(), capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stderr
        assert "labelled 4 assistant turns of 3 conversations" in run.stdout
        labelled = [json.loads(line) for line in out.read_text().splitlines()]
        got = [t["label"] for r in labelled for t in r["conversations"] if t["from"] == "Assistant"]
        assert got == expected
        assert all("label" not in t for r in labelled for t in r["conversations"] if t["from"] == "User")
        assert labelled[0]["system"] == "be brief" and "__line__" not in labelled[0]
        wrong = subprocess.run([sys.executable, script, "--input-file", str(source), "--output-file",
                                str(tmp_path / "x.jsonl"), "--port", str(server.port), "--attributes", "quality"],
                               env=subprocess_env(), capture_output=True, text=True, timeout=120)
        assert wrong.returncode == 1 and "names 1 attributes (quality) but the server returns 2" in wrong.stderr
        assert not (tmp_path / "x.jsonl").exists()


@pytest.mark.learning
def test_attribute_value_in_the_prompt_steers_generation(tmp_path, steerlm_nemo):
    """SteerLM SFT from the SFT model on built-in chat data labelled quality:0-4 (half right, half
    wrong answers; the ``steerlm_nemo`` fixture); then greedy generation on held-out prompts asking
    for quality 0, 2 and 4. Measured mean task score: ~0.42 (quality:0), ~0.82 (quality:2), ~0.91 (quality:4)."""
    from nemo_aligner.data.nlp.builtin_task import BuiltinTask

    nemo, data = steerlm_nemo
    prompts = [json.loads(line)["conversations"][0]["value"] for line in open(data["steerlm_val"])]
    prompts_file = tmp_path / "prompts.jsonl"  # every prompt three times, each asking for its own quality
    prompts_file.write_text("".join(json.dumps({"prompt": p, "attributes": {"quality": q}}) + "\n"
                                    for q in (0, 2, 4) for p in prompts))
    out = tmp_path / "steered.jsonl"
    run_script("generate_gpt.py", [f"gpt_model_file={nemo}", f"prompts_file={prompts_file}", f"output_file={out}",
                                   "steerlm.attributes={quality: 9}", "inference.tokens_to_generate=12",
                                   "inference.end_strings=['\n']", "batch_size=64"])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["prompt"], r["attributes"]) for r in rows] == [(p, f"quality:{q}") for q in (0, 2, 4) for p in prompts]
    scores = {}
    for i, quality in enumerate((0, 2, 4)):
        chunk = rows[i * len(prompts):(i + 1) * len(prompts)]
        scores[quality] = sum(BuiltinTask.score(BuiltinTask.prompt_text(r["prompt"]), r["response"]) for r in chunk) / len(chunk)
    print("mean task score by requested quality:", scores)
    assert scores[0] < scores[2] <= scores[4] + 0.05, scores
    assert scores[4] - scores[0] >= 0.3, scores


def test_generate_prompts_take_their_own_attributes(tmp_path):
    """generate_gpt.py's prompts: a record's ``attributes`` wins over steerlm.attributes; bad ones name
    the file, line and field."""
    from nemo_aligner.recipes.generate import read_prompts

    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "a", "attributes": "quality:1"}\n{"prompt": "b"}\n{"input": "c", "attributes": {"quality": 3}}\n')
    cfg = OmegaConf.create({"prompts": ["z"], "prompts_file": str(f), "steerlm": {"attributes": {"quality": 4}}})
    assert read_prompts(cfg) == [("z", "quality:4"), ("a", "quality:1"), ("b", "quality:4"), ("c", "quality:3")]
    cfg.steerlm.attributes = None
    assert read_prompts(cfg)[:3] == [("z", None), ("a", "quality:1"), ("b", None)]
    for bad, message in (('"quality=4"', r"p\.jsonl:2: attributes: attribute 'quality=4'"),
                         ('{"quality": "high"}', r"p\.jsonl:2: attributes: must be a label string"),
                         ('[4]', r"p\.jsonl:2: attributes: must be a label string")):
        f.write_text('{"prompt": "a"}\n{"prompt": "b", "attributes": ' + bad + '}\n')
        with pytest.raises(DataError, match=message):
            read_prompts(cfg)
    with pytest.raises(DataError, match=r"steerlm\.attributes: attribute 'x'"):
        read_prompts(OmegaConf.create({"prompts": ["z"], "steerlm": {"attributes": "x"}}))


def test_generate_inputs_follow_what_training_did():
    """A string `prompts` is one prompt; string attributes are normalised to training's label form;
    typed escapes in end strings are the characters; the model's own chat tokens build the prompt."""
    from nemo_aligner.recipes.generate import model_chat_tokens, read_prompts, unescape

    assert read_prompts(OmegaConf.create({"prompts": "sort dcba ="})) == [("sort dcba =", None)]
    cfg = OmegaConf.create({"prompts": ["z"], "steerlm": {"attributes": "quality: 4.0, verbosity:1"}})
    assert read_prompts(cfg) == [("z", "quality:4,verbosity:1")]
    with pytest.raises(DataError, match=r"steerlm\.attributes: an empty label"):
        read_prompts(OmegaConf.create({"prompts": ["z"], "steerlm": {"attributes": " "}}))
    assert unescape("\\n") == "\n" and unescape("a\\tb\\\\n") == "a\tb\\n" and unescape("x\n") == "x\n"
    custom = {"system_turn_start": "<extra_id_0>", "turn_start": "<extra_id_1>", "label_start": "<extra_id_2>",
              "end_of_turn": "\n", "end_of_name": "\n"}
    tokens = model_chat_tokens(OmegaConf.create({"data": {"chat_prompt_tokens": custom}}))
    assert tokens == custom and model_chat_tokens(OmegaConf.create({})) is None
    assert steer_prompt("q", "quality:4", chat_tokens=tokens) == \
        "<extra_id_0>System\n\n<extra_id_1>User\nq\n<extra_id_1>Assistant\n<extra_id_2>quality:4\n"


def test_annotation_renders_and_truncates_as_training_does():
    """A null system is rendered empty (as SFT does); texts keep their last seq_length tokens (as
    reward-model training does); non-finite server values and an empty clip range are errors."""
    from nemo_aligner.data.nlp.steerlm_annotate import annotate_records
    from nemo_aligner.servers.clients import RemoteGPTRMClient
    from nemo_aligner.utils.errors import ConfigError

    record = dict(CHAT, system=None, __line__=3)
    assert assistant_turn_texts(record)[0][1] == render_turns("", CHAT["conversations"][:2], with_labels=False)

    class Done:
        def __init__(self, value):
            self.value = value

        def result(self):
            return self.value

    class Client:  # the real client's tokenization, no server
        infer_texts = RemoteGPTRMClient.infer_texts

        def __init__(self, values):
            self.tokenizer, self.values, self.sent = ByteTokenizer(), values, []

        def infer_tokens(self, tokens, lengths):
            self.sent.append([list(row[:n]) for row, n in zip(tokens, lengths)])
            return Done(self.values[: len(lengths)])

    client = Client([[1.0, 2.0], [3.0, 0.0]])
    texts = [t for _, t in assistant_turn_texts(record)]
    assert annotate_records([record], client, ["quality", "verbosity"], max_length=10, where="c.jsonl") == 2
    tok = ByteTokenizer()
    assert client.sent[0] == [(tok.text_to_ids(t) + [tok.eos_id])[-10:] for t in texts]
    assert record["conversations"][1]["label"] == "quality:1,verbosity:2"
    with pytest.raises(DataError, match=r"c\.jsonl:3: conversations\[1\]: the server returned non-finite values"):
        annotate_records([dict(CHAT, __line__=3)], Client([[float("nan"), 1.0], [1.0, 1.0]]), ["quality", "verbosity"],
                         where="c.jsonl")
    with pytest.raises(ConfigError, match=r"--min-value 5 is above --max-value 4"):
        annotate_records([dict(CHAT, __line__=3)], client, ["quality", "verbosity"], min_value=5, max_value=4)
