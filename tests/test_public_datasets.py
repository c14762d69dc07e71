"""examples/nlp/data/: the public datasets' published files (tiny copies in their formats) become
files the training scripts load."""

import gzip
import json
import os
import subprocess
import sys

import pytest

from conftest import REPO, subprocess_env
from nemo_aligner.data.nlp.jsonl import read_jsonl
from nemo_aligner.utils.tokenizers import ByteTokenizer

DATA = os.path.join(REPO, "examples", "nlp", "data")
TOK = ByteTokenizer()

HH = [
    {"chosen": "\n\nHuman: Hi there\n\nAssistant: Hello!\n\nHuman: What is 2+2?\n\nAssistant: 4.",
     "rejected": "\n\nHuman: Hi there\n\nAssistant: Hello!\n\nHuman: What is 2+2?\n\nAssistant: 5."},
    {"chosen": "\n\nHuman: Name a colour.\n\nAssistant: Blue.",
     "rejected": "\n\nHuman: Name a colour.\n\nAssistant: I will not."},
    # the transcripts differ before the last answer: skipped
    {"chosen": "\n\nHuman: A\n\nAssistant: B\n\nHuman: C\n\nAssistant: D",
     "rejected": "\n\nHuman: A\n\nAssistant: X\n\nHuman: C\n\nAssistant: E"},
]


def write_jsonl(path, rows, gz=False):
    text = "".join(json.dumps(r) + "\n" for r in rows)
    if gz:
        with gzip.open(path, "wt", encoding="utf-8") as f:
            f.write(text)
    else:
        path.write_text(text, encoding="utf-8")
    return str(path)


def run(script, *args):
    proc = subprocess.run([sys.executable, os.path.join(DATA, script), *map(str, args)], env=subprocess_env(),
                          capture_output=True, text=True, timeout=120)
    return proc


def test_dolly_to_sft(tmp_path):
    from nemo_aligner.data.nlp.sft_dataset import GPTSFTDataset

    rows = [{"instruction": "When did it start?", "context": "It started in 2000.", "response": "In 2000.",
             "category": "closed_qa"},
            {"instruction": "Name a fruit.", "context": "", "response": "Apple.", "category": "open_qa"}]
    src = write_jsonl(tmp_path / "databricks-dolly-15k.jsonl", rows)
    proc = run("sft/preprocess_dolly.py", "--input", src)
    assert proc.returncode == 0, proc.stderr
    out = read_jsonl(str(tmp_path / "databricks-dolly-15k-output.jsonl"))
    assert out[0]["input"] in ("It started in 2000.\n\nWhen did it start?", "When did it start?\n\nIt started in 2000.")
    assert out[1] == {"input": "Name a fruit.", "output": "Apple.", "category": "open_qa", "__line__": 2}
    again = run("sft/preprocess_dolly.py", "--input", src, "--output", tmp_path / "again.jsonl")
    assert again.returncode == 0 and read_jsonl(str(tmp_path / "again.jsonl"))[0]["input"] == out[0]["input"]  # seeded
    ds = GPTSFTDataset(str(tmp_path / "databricks-dolly-15k-output.jsonl"), TOK, 128)
    assert TOK.ids_to_text(ds[1]["input_ids"]) == "Name a fruit. Apple."


def test_anthropic_hh_to_rm_ppo_dpo_kto(tmp_path):
    from nemo_aligner.data.nlp.dpo_dataset import DPOPairDataset
    from nemo_aligner.data.nlp.kto_dataset import KTODataset
    from nemo_aligner.data.nlp.reward_datasets import RewardComparisonDataset

    src = tmp_path / "hh"
    src.mkdir()
    write_jsonl(src / "train.jsonl.gz", HH, gz=True)
    write_jsonl(src / "test.jsonl", HH[:2])
    proc = run("anthropichh/process_anthropic_hh.py", "--input-dir", src, "--output-dir", tmp_path / "out")
    assert proc.returncode == 0, proc.stderr
    assert "1 pairs skipped" in proc.stdout
    out = tmp_path / "out"
    comparisons = read_jsonl(str(out / "train_comparisons.jsonl"))
    prompt = "User: Hi there\n\nAssistant: Hello!\n\nUser: What is 2+2?\n\nAssistant:"
    assert [c["text"] for c in comparisons[:2]] == [prompt + " 4.", prompt + " 5."]
    assert len(comparisons) == 4
    assert read_jsonl(str(out / "train_prompts.jsonl"))[0]["text"] == prompt
    dpo = read_jsonl(str(out / "test_dpo.jsonl"))
    assert (dpo[1]["prompt"], dpo[1]["chosen_response"], dpo[1]["rejected_response"]) == \
        ("User: Name a colour.\n\nAssistant: ", "Blue.", "I will not.")
    assert len(RewardComparisonDataset(str(out / "train_comparisons.jsonl"), TOK, 256)) == 2
    assert len(DPOPairDataset(str(out / "train_dpo.jsonl"), TOK, 256)) == 2
    kto = run("kto/preprocess_anthropichh_data.py", "--input-dir", src, "--output-dir", tmp_path / "kto")
    assert kto.returncode == 0, kto.stderr
    rows = read_jsonl(str(tmp_path / "kto" / "train.jsonl"))
    assert [r["preference"] for r in rows] == ["chosen", "rejected"] * 2
    assert rows[0]["prompt"] == prompt + " "  # the whole history, not only the last exchange
    assert len(KTODataset(str(tmp_path / "kto" / "train.jsonl"), TOK, 256)) == 4


def test_hh_errors_name_file_and_line(tmp_path):
    src = tmp_path / "hh"
    src.mkdir()
    write_jsonl(src / "train.jsonl", [HH[0], {"chosen": "Human: no markers", "rejected": "x"}])
    write_jsonl(src / "test.jsonl", HH[:1])
    proc = run("anthropichh/process_anthropic_hh.py", "--input-dir", src, "--output-dir", tmp_path / "out")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert f"error: {src / 'train.jsonl'}:2: a transcript must start with" in proc.stderr
    missing = run("anthropichh/process_anthropic_hh.py", "--input-dir", tmp_path / "nowhere")
    assert missing.returncode == 1 and "no train.jsonl or train.jsonl.gz" in missing.stderr
    assert not (tmp_path / "out" / "test_dpo.jsonl").exists()  # nothing half-written


CAI_HH = os.path.join(REPO, "examples", "nlp", "cai", "process_anthropic_hh_using_chat_prompt.py")


def run_cai_hh(*args):
    return subprocess.run([sys.executable, CAI_HH, *map(str, args)], env=subprocess_env(), capture_output=True,
                          text=True, timeout=120)


def test_anthropic_hh_in_a_chat_template_for_cai(tmp_path):
    """NeMo-Aligner's CAI preparation of HH: its default <extra_id_*> template (with the empty system
    turn), the whole history, eos appended; pairs that do not parse are dropped."""
    from nemo_aligner.data.nlp.dpo_dataset import DPOPairDataset
    from nemo_aligner.data.nlp.reward_datasets import RewardComparisonDataset

    hh = tmp_path / "hh-rlhf"
    odd = [  # an empty answer, two answers to one turn, a trailing "Human:" (cut off) and a differing history
        {"chosen": "\n\nHuman: Q\n\nAssistant: ", "rejected": "\n\nHuman: Q\n\nAssistant: no"},
        {"chosen": "\n\nHuman: Q\n\nAssistant: a\n\nAssistant: b", "rejected": "\n\nHuman: Q\n\nAssistant: c"},
        {"chosen": "\n\nHuman: Hey\n\nAssistant: Hi.\n\nHuman:", "rejected": "\n\nHuman: Hey\n\nAssistant: Go.\n\nHuman:"},
    ]
    for subset, rows in (("helpful-base", HH + odd), ("helpful-online", HH[1:2])):
        (hh / subset).mkdir(parents=True)
        write_jsonl(hh / subset / "train.jsonl.gz", rows, gz=True)
        write_jsonl(hh / subset / "test.jsonl.gz", HH[:1], gz=True)
    out = tmp_path / "out"
    proc = run_cai_hh("--input-dir", hh, "--output-dir", out, "--dataset-dir-name", "helpful-base", "helpful-online",
                      "--output-file-name-prefix", "helpful")
    assert proc.returncode == 0, proc.stderr
    assert "train: 3 pairs dropped" in proc.stdout
    sys_turn, user, eos = "<extra_id_0>System\n\n", "<extra_id_1>User\n{}\n<extra_id_1>Assistant\n", "<extra_id_1>"
    prompt = sys_turn + user.format("Hi there") + "Hello!\n" + user.format("What is 2+2?")
    prompts = [r["text"] for r in read_jsonl(str(out / "helpful_train_prompts_with_chat_prompt.jsonl"))]
    assert prompts == [prompt, sys_turn + user.format("Name a colour."), sys_turn + user.format("Hey"),
                       sys_turn + user.format("Name a colour.")]
    comparisons = [r["text"] for r in read_jsonl(str(out / "helpful_train_comparisons_with_chat_prompt.jsonl"))]
    assert comparisons[:2] == [prompt + "4.\n" + eos, prompt + "5.\n" + eos]
    assert comparisons[4:6] == [prompts[2] + "Hi.\n" + eos, prompts[2] + "Go.\n" + eos]
    assert len(comparisons) == 8
    dpo = read_jsonl(str(out / "helpful_test_dpo_with_chat_prompt.jsonl"))
    assert (dpo[0]["prompt"], dpo[0]["chosen_response"], dpo[0]["rejected_response"]) == (prompt, "4.\n" + eos, "5.\n" + eos)
    assert len(RewardComparisonDataset(str(out / "helpful_train_comparisons_with_chat_prompt.jsonl"), TOK, 512)) == 4
    assert len(DPOPairDataset(str(out / "helpful_test_dpo_with_chat_prompt.jsonl"), TOK, 512)) == 2  # one per subset

    # NeMo-Aligner's --add-eos False names, and a template of the user's (Mistral's, no system turn)
    plain = run_cai_hh("--input-dir", hh, "--output-dir", out, "--dataset-dir-name", "helpful-online",
                       "--add-eos", "False", "--user_format", "[INST] {MESSAGE} [/INST]", "--assistant_format",
                       "{MESSAGE}</s> ", "--system_format", "", "--bos_token", "<s>", "--eos_token", "</s>")
    assert plain.returncode == 0, plain.stderr
    rows = read_jsonl(str(out / "train_comparisons_with_chat_prompt_no_extra_id_eos.jsonl"))
    assert [r["text"] for r in rows] == ["<s>[INST] Name a colour. [/INST]Blue.</s> ",
                                         "<s>[INST] Name a colour. [/INST]I will not.</s> "]


def test_cai_hh_refusals_are_one_line(tmp_path, capsys, monkeypatch):
    """In process: each refusal leaves by SystemExit(1) with one ``error:`` line (any other exception
    fails the test)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("process_hh_chat", CAI_HH)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)

    def refusal(*args):
        with pytest.raises(SystemExit) as leave:
            script.main([*map(str, args)])
        text = capsys.readouterr().err + (leave.value.code if isinstance(leave.value.code, str) else "")
        assert leave.value.code in (1,) or str(leave.value.code).startswith("error: "), leave.value.code
        assert len(text.strip().splitlines()) == 1, text
        return text

    hh = tmp_path / "hh-rlhf"
    (hh / "helpful-base").mkdir(parents=True)
    write_jsonl(hh / "helpful-base" / "train.jsonl", HH)  # no test split
    cases = [(["--dataset-dir-name", "helpful-base"], "no test.jsonl or test.jsonl.gz"),
             (["--dataset-dir-name", "red-team"], "--dataset-dir-name 'red-team' is not one of"),
             (["--dataset-dir-name", "helpful-base", "helpful-base"], "names a subset twice"),
             (["--dataset-dir-name", "helpful-base", "--user_format", "User:"], "--user_format='User:' must contain")]
    for extra, message in cases:
        assert message in refusal("--input-dir", hh, "--output-dir", tmp_path / "out", *extra)
    assert not (tmp_path / "out").exists()  # the train split is not written when the test split is missing
    monkeypatch.setitem(sys.modules, "datasets", None)  # not installed
    assert "--input-dir is not set and Hugging Face datasets is not installed" in refusal("--output-dir", tmp_path / "out")


def test_cai_hh_through_hugging_face_datasets(tmp_path, monkeypatch):
    """Without --input-dir the subsets come from ``datasets.load_dataset("Anthropic/hh-rlhf", data_dir=,
    split=)`` (NeMo-Aligner's call), giving the files a local copy gives."""
    import importlib.util
    import types

    calls = []

    def load_dataset(name, data_dir, split):
        calls.append((name, data_dir, split))
        return list(HH if split == "train" else HH[:1])

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    spec = importlib.util.spec_from_file_location("process_hh_chat_hf", CAI_HH)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    script.main(["--output-dir", str(tmp_path / "hub"), "--dataset-dir-name", "helpful-base"])
    assert calls == [("Anthropic/hh-rlhf", "helpful-base", "train"), ("Anthropic/hh-rlhf", "helpful-base", "test")]

    (tmp_path / "hh" / "helpful-base").mkdir(parents=True)
    write_jsonl(tmp_path / "hh" / "helpful-base" / "train.jsonl", HH)
    write_jsonl(tmp_path / "hh" / "helpful-base" / "test.jsonl", HH[:1])
    script.main(["--input-dir", str(tmp_path / "hh"), "--output-dir", str(tmp_path / "local"),
                 "--dataset-dir-name", "helpful-base"])
    names = sorted(os.listdir(tmp_path / "local"))
    assert len(names) == 6 and sorted(os.listdir(tmp_path / "hub")) == names
    for name in names:
        assert (tmp_path / "hub" / name).read_text() == (tmp_path / "local" / name).read_text(), name
    assert read_jsonl(str(tmp_path / "hub" / "train_prompts_with_chat_prompt.jsonl"))


def test_helpsteer_and_helpsteer2_to_steerlm(tmp_path):
    from nemo_aligner.data.nlp.sft_dataset import GPTSFTChatDataset

    src = tmp_path / "hs"
    src.mkdir()
    row = {"prompt": "Sort ba", "response": "ab", "helpfulness": 3, "correctness": 4, "coherence": 4,
           "complexity": 1, "verbosity": 0}
    write_jsonl(src / "train.jsonl", [row, dict(row, response="ba", helpfulness=0)])
    write_jsonl(src / "validation.jsonl", [row])
    proc = run("steerlm/preprocess_helpsteer_data.py", "--input-dir", src, "-dir", tmp_path / "out")
    assert proc.returncode == 0, proc.stderr
    train = read_jsonl(str(tmp_path / "out" / "train.jsonl"))
    assert train[0]["conversations"][1]["label"] == "helpfulness:3,correctness:4,coherence:4,complexity:1,verbosity:0"
    assert train[0]["type"] == "VALUE_TO_TEXT" and train[0]["mask"] == "User"
    ds = GPTSFTChatDataset(str(tmp_path / "out" / "train.jsonl"), TOK, 512)
    assert "\x12helpfulness:3,correctness:4" in ds.render(ds.records[0])  # the label is rendered for SteerLM SFT
    only = run("steerlm/preprocess_helpsteer2_data.py", "--input-dir", src, "-dir", tmp_path / "oh", "-oh")
    assert only.returncode == 0, only.stderr
    assert read_jsonl(str(tmp_path / "oh" / "val.jsonl"))[0]["conversations"][1]["label"] == "helpfulness:3"
    write_jsonl(src / "preference.jsonl", [
        {"prompt": "p", "response_1": "a", "response_2": "b", "preference_strength": -2, "split": "train"},
        {"prompt": "q", "response_1": "c", "response_2": "d", "preference_strength": 1, "split": "val"}])
    pref = run("steerlm/preprocess_helpsteer2_data.py", "--input-dir", src, "-dir", tmp_path / "pref", "-pref")
    assert pref.returncode == 0, pref.stderr
    train = read_jsonl(str(tmp_path / "pref" / "train.jsonl"))
    assert [r["conversations"][1]["label"] for r in train] == ["quality:-2", "quality:-2"]
    assert [r["conversations"][1]["value"] for r in read_jsonl(str(tmp_path / "pref" / "val.jsonl"))] == ["c", "d"]


def test_openassistant_trees_to_steerlm(tmp_path):
    from nemo_aligner.data.nlp.public_datasets import oasst_to_steerlm

    def msg(text, role, replies=(), labels=None):
        m = {"message_id": text, "text": text, "role": role, "replies": list(replies)}
        if labels:
            m["labels"] = {k: {"value": v, "count": 3} for k, v in labels.items()}
        return m

    tree = {"message_tree_id": "t1", "prompt": msg("Q", "prompter", [
        msg("A1", "assistant", [msg("Q2", "prompter", [msg("A2", "assistant", labels={"quality": 0.5})])],
            labels={"quality": 0.75, "toxicity": 0.0, "humor": 0.25, "spam": 0.0}),
        msg("B1", "assistant")])}
    lone = {"message_tree_id": "t2", "prompt": msg("alone", "prompter")}
    out = tmp_path / "oa"
    out.mkdir()
    write_jsonl(out / "2023-04-12_oasst_all.trees.jsonl.gz", [tree, lone], gz=True)
    proc = run("steerlm/preprocess_openassistant_data.py", "-dir", out)
    assert proc.returncode == 0, proc.stderr
    records = [json.loads(line) for name in ("train.jsonl", "val.jsonl")
               for line in (out / name).read_text().splitlines()]  # 1 tree each: one may have no thread
    threads = sorted([t["value"] for t in r["conversations"]] for r in records)
    assert threads == [["Q", "A1", "Q2", "A2"], ["Q", "B1"]]  # one per root-to-leaf thread; the lone prompt dropped
    long = next(r for r in records if len(r["conversations"]) == 4)
    assert [t["label"] for t in long["conversations"]] == [None, "quality:3,toxicity:0,humor:1", None, "quality:2"]
    train, val = oasst_to_steerlm([dict(tree, __line__=i) for i in range(40)], "x", val_fraction=0.05)
    assert len(val) == 2 * 2 and len(train) == 38 * 2  # split by tree: the first 95% (seeded shuffle) train


def test_chat_to_regression_format(tmp_path):
    from nemo_aligner.data.nlp.reward_datasets import RegressionRewardDataset
    from nemo_aligner.data.nlp.steerlm_labels import assistant_turn_texts

    record = {"system": "S", "mask": "User", "type": "VALUE_TO_TEXT", "conversations": [
        {"from": "User", "value": "Sort ba", "label": None},
        {"from": "Assistant", "value": "ab", "label": "helpfulness:3,verbosity:0"},
        {"from": "User", "value": "again", "label": None}, {"from": "Assistant", "value": "ab", "label": None}]}
    src = write_jsonl(tmp_path / "chat.jsonl", [record])
    proc = run("steerlm/process_to_regression_format.py", "--input-file", src, "--output-file", tmp_path / "reg.jsonl")
    assert proc.returncode == 0, proc.stderr
    rows = read_jsonl(str(tmp_path / "reg.jsonl"))
    assert len(rows) == 1  # the unlabelled turn gives none
    assert rows[0]["text"] == assistant_turn_texts(record)[0][1]  # what attribute_annotate.py scores
    assert rows[0]["label"] == [-100, -100, -100, -100, 3, -100, -100, -100, 0]
    ds = RegressionRewardDataset(str(tmp_path / "reg.jsonl"), TOK, 256, 9)
    assert len(ds) == 1
    bad = run("steerlm/process_to_regression_format.py", "--input-file", src, "--output-file", tmp_path / "x.jsonl",
              "--attributes", "quality")
    assert bad.returncode == 1 and "outside --attributes quality" in bad.stderr
    for turn, message in (({"value": "ab", "label": None}, "conversations[1] must be an object with 'from' and 'value'"),
                          ({"from": "Assistant", "value": 3}, "conversations[1].value must be str, got int")):
        broken = dict(record, conversations=[record["conversations"][0], turn])
        src = write_jsonl(tmp_path / "broken.jsonl", [record, broken])
        proc = run("steerlm/process_to_regression_format.py", "--input-file", src, "--output-file", tmp_path / "y.jsonl")
        assert proc.returncode == 1 and "Traceback" not in proc.stderr
        assert f"{src}:2: {message}" in proc.stderr
        assert not (tmp_path / "y.jsonl").exists()


def _chat(turns, **extra):
    return {"system": "", "mask": "User", "conversations": [{"from": who, "value": text} for who, text in turns], **extra}


def test_remove_long_dialogues_keeps_what_trains(tmp_path, base_nemo, capsys):
    """NeMo-Aligner's remove_long_dialogues.py: records left with no trained token at --seq_len go,
    the rest are written with its fields (plus the chat type); the tokenizer from a SentencePiece
    model or a .nemo."""
    import sentencepiece as spm

    from nemo_aligner.data.nlp.sft_dataset import GPTSFTChatDataset
    from nemo_aligner.utils.nemo_file import tokenizer_from_path

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(["the quick brown fox jumps over the lazy dog", "hello there how are you",
                                 "User Assistant System extra_id"] * 50))
    spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(tmp_path / "sp"), vocab_size=80,
                                   model_type="bpe", character_coverage=1.0, minloglevel=2)
    records = [
        _chat([("User", "hello there"), ("Assistant", "how are you")], dataset="mine", extra="dropped key"),
        _chat([("User", "the quick brown fox " * 40), ("Assistant", "over the lazy dog")]),  # the answer is cut off
        _chat([("User", "hello"), ("User", "there")]),  # nothing to train on at any length
        {"conversations": [{"from": "User"}]},  # not a chat record
        _chat([("User", "hello"), ("Assistant", "fox")], type="VALUE_TO_TEXT"),
    ]
    records[4]["conversations"][1]["label"] = "quality:4"
    src = write_jsonl(tmp_path / "chat.jsonl", records)
    import importlib.util

    spec = importlib.util.spec_from_file_location("remove_long_dialogues", os.path.join(DATA, "sft",
                                                                                       "remove_long_dialogues.py"))
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    for tokenizer in (str(tmp_path / "sp.model"), base_nemo[0]):
        out = tmp_path / f"fits_{os.path.basename(tokenizer)}.jsonl"
        script.main(["--tokenizer_path", tokenizer, "--dataset_file", src, "--output_file", str(out), "--seq_len", "64"])
        printed = capsys.readouterr().out
        assert "removed 3/5 records" in printed
        assert f"{src}:2: no trained token in its first 65 tokens" in printed
        assert f"{src}:3: no trained token" in printed and f"{src}:4: conversations[0]" in printed
        kept = [{k: v for k, v in r.items() if k != "__line__"} for r in read_jsonl(str(out))]
        assert kept[0] == {"system": "", "mask": "User", "dataset": "mine", "conversations": [
            {"from": "User", "value": "hello there", "canoncial_form": "", "label": None},
            {"from": "Assistant", "value": "how are you", "canoncial_form": "", "label": None}]}
        assert kept[1]["type"] == "VALUE_TO_TEXT" and kept[1]["conversations"][1]["label"] == "quality:4"
        tok = tokenizer_from_path(tokenizer)
        dataset = GPTSFTChatDataset(str(out), tok, 64)
        assert all(dataset.trained_tokens(dataset[i]) > 0 for i in range(len(dataset)))
        long_one = GPTSFTChatDataset(src, tok, 4096, records=[read_jsonl(src)[1]])
        assert long_one.trained_tokens(long_one[0]) > 0  # removed for its length only

    with pytest.raises(SystemExit) as leave:  # one error line, exit 1
        script.main(["--tokenizer_path", str(tmp_path / "sp.model"), "--dataset_file",
                     write_jsonl(tmp_path / "long.jsonl", records[1:3]), "--output_file", str(tmp_path / "none.jsonl"),
                     "--seq_len", "64"])
    assert leave.value.code == 1
    assert "every one of its 2 records would train on nothing at --seq_len=64" in capsys.readouterr().err
    assert not (tmp_path / "none.jsonl").exists()


# The scripts that convert datasets read and write jsonl only (the others pack with a tokenizer, or
# call a model or a server).
CONVERTERS = ["anthropichh/process_anthropic_hh.py", "kto/preprocess_anthropichh_data.py", "sft/preprocess_dolly.py",
              "sft/remove_long_dialogues.py", "steerlm/preprocess_helpsteer2_data.py",
              "steerlm/preprocess_helpsteer_data.py", "steerlm/preprocess_openassistant_data.py",
              "steerlm/process_to_regression_format.py"]


def test_dataset_converters_start_without_torch():
    """Their imports (what runs before the work, and all of ``--help``) leave torch and megatron-core
    unloaded: about a second less per run."""
    code = ("import runpy, sys\nfor path in sys.argv[1:]:\n    runpy.run_path(path, run_name='probe')\n"
            "print(sorted(m for m in ('torch', 'megatron.core') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code, *(os.path.join(DATA, p) for p in CONVERTERS)],
                          env=subprocess_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "[]", proc.stdout
