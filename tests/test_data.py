"""Datasets, masks, collation, the global-batch sampler and the built-in task."""

import json

import pytest

from nemo_aligner.data.nlp.builtin_task import BuiltinTask
from nemo_aligner.data.nlp.samplers import GlobalBatchSampler
from nemo_aligner.data.nlp.sft_dataset import GPTSFTChatDataset, GPTSFTDataset, collate_sft
from nemo_aligner.utils.errors import ConfigError, DataError
from nemo_aligner.utils.tokenizers import ByteTokenizer

TOK = ByteTokenizer()


def records(*rows):
    return [dict(r, __line__=i + 1) for i, r in enumerate(rows)]


def test_answer_only_loss_masks_prompt_tokens():
    ds = GPTSFTDataset("x.jsonl", TOK, 64, records=records({"input": "reverse abc =", "output": "cba"}))
    batch = collate_sft([ds[0]], TOK.eos_id, 64)
    text = "reverse abc = cba"
    ids = TOK.text_to_ids(text) + [TOK.eos_id]
    n = len(ids) - 1
    assert batch["tokens"][0, :n].tolist() == ids[:-1]
    assert batch["labels"][0, :n].tolist() == ids[1:]
    # Label positions whose target is an answer token ("cba") or EOS carry loss; nothing else does.
    trained = [TOK.ids_to_text([t]) if t < 256 else "<eos>"
               for t, m in zip(batch["labels"][0].tolist(), batch["loss_mask"][0].tolist()) if m]
    assert trained == ["c", "b", "a", "<eos>"]
    assert batch["loss_mask"][0].sum() == 4
    assert batch["lengths"].tolist() == [n]
    assert batch["tokens"].shape[1] % 8 == 0


def test_full_loss_without_answer_only():
    ds = GPTSFTDataset("x.jsonl", TOK, 64, answer_only_loss=False,
                       records=records({"input": "reverse abc =", "output": "cba"}))
    batch = collate_sft([ds[0]], TOK.eos_id, 64)
    n = len("reverse abc = cba")  # every label position of the real sequence
    assert batch["loss_mask"][0, :n].tolist() == [1.0] * n
    assert batch["loss_mask"][0, n:].sum() == 0


def test_truncation_keeps_answer_and_cuts_context():
    long_input = "reverse " + "x" * 100 + " ="
    ds = GPTSFTDataset("x.jsonl", TOK, 16, records=records({"input": long_input, "output": "abc"}))
    sample = ds[0]
    assert len(sample["input_ids"]) == 17  # 16 model positions + 1
    assert TOK.ids_to_text(sample["input_ids"][sample["answer_start"]:]) == "abc"
    left = GPTSFTDataset("x.jsonl", TOK, 16, truncation_method="left", records=records({"input": long_input, "output": "abc"}))
    assert TOK.ids_to_text(left[0]["input_ids"][: left[0]["answer_start"]]).endswith("x = ")


def test_prompt_template_and_label_key():
    ds = GPTSFTDataset("x.jsonl", TOK, 64, prompt_template="Q: {question}\nA: {answer}", label_key="answer",
                       records=records({"question": "2+2?", "answer": "4"}))
    s = ds[0]
    assert TOK.ids_to_text(s["input_ids"]) == "Q: 2+2?\nA: 4"
    assert TOK.ids_to_text(s["input_ids"][s["answer_start"]:]) == "4"
    with pytest.raises(DataError, match=r"x\.jsonl:1: missing field 'question'"):
        GPTSFTDataset("x.jsonl", TOK, 64, prompt_template="Q: {question}\nA: {answer}", label_key="answer",
                      records=records({"input": "2+2?", "answer": "4"}))
    with pytest.raises(ConfigError, match="does not contain {output}"):
        GPTSFTDataset("x.jsonl", TOK, 64, prompt_template="{input}", records=records({"input": "a"}))


def _trained_spans(ds, sample):
    """The trained text, one string per run of consecutive trained tokens (byte tokenizer)."""
    spans, current = [], ""
    for t, m in zip(sample["input_ids"], sample["target_mask"]):
        if m:
            current += chr(t)
        elif current:
            spans.append(current)
            current = ""
    return spans + ([current] if current else [])


CHAT_CASES = [
    # NeMo's GPTSFTChatDataset on these records (gpt_sft_chat_dataset.py, run with a character tokenizer):
    # no EOS; turn 0 never trained; the turn start opening a later User turn and the trailing one trained.
    ({"system": "SYS", "mask": "User", "conversations": [{"from": "User", "value": "Hi"},
                                                         {"from": "Assistant", "value": "Hello"}]},
     "\x00System\nSYS\n\x11User\nHi\n\x11Assistant\nHello\n\x11", ["Hello\n\x11"]),
    ({"system": "SYS", "mask": "User", "conversations": [
        {"from": "User", "value": "Hi"}, {"from": "Assistant", "value": "Hello"},
        {"from": "User", "value": "Q2"}, {"from": "Assistant", "value": "A2"}]},
     "\x00System\nSYS\n\x11User\nHi\n\x11Assistant\nHello\n\x11User\nQ2\n\x11Assistant\nA2\n\x11",
     ["Hello\n\x11", "A2\n\x11"]),
    ({"system": "SYS", "mask": "User", "conversations": [  # ends with User: no trailing turn start
        {"from": "User", "value": "Hi"}, {"from": "Assistant", "value": "Hello"}, {"from": "User", "value": "Q2"}]},
     "\x00System\nSYS\n\x11User\nHi\n\x11Assistant\nHello\n\x11User\nQ2\n", ["Hello\n\x11"]),
    ({"system": "SYS", "mask": "User", "type": "VALUE_TO_TEXT", "conversations": [
        {"from": "User", "value": "Hi"}, {"from": "Assistant", "value": "Hello", "label": "quality:4"},
        {"from": "User", "value": "Q2"}, {"from": "Assistant", "value": "A2", "label": "quality:3"}]},
     "\x00System\nSYS\n\x11User\nHi\n\x11Assistant\n\x12quality:4\nHello\n\x11User\nQ2\n\x11Assistant\n"
     "\x12quality:3\nA2\n\x11", ["Hello\n\x11", "A2\n\x11"]),
    ({"system": "SYS", "mask": "User", "type": "TEXT_TO_VALUE", "conversations": [
        {"from": "User", "value": "Hi"}, {"from": "Assistant", "value": "Hello", "label": "quality:4"},
        {"from": "User", "value": "Q2"}, {"from": "Assistant", "value": "A2", "label": "quality:3"}]},
     "\x00System\nSYS\n\x11User\nHi\n\x11Assistant\nHello\n\x12quality:4\n\x11User\nQ2\n\x11Assistant\n"
     "A2\n\x12quality:3\n\x11", ["quality:4\n\x11", "quality:3\n\x11"]),
    ({"system": "SYS", "mask": "User", "conversations": [  # labels without "type" are not rendered
        {"from": "User", "value": "Hi"}, {"from": "Assistant", "value": "Hello", "label": "quality:4"}]},
     "\x00System\nSYS\n\x11User\nHi\n\x11Assistant\nHello\n\x11", ["Hello\n\x11"]),
    ({"system": "SYS", "mask": "User", "conversations": [  # the first turn is context even from the Assistant
        {"from": "Assistant", "value": "Hi"}, {"from": "User", "value": "Yo"}, {"from": "Assistant", "value": "Ok"}]},
     "\x00System\nSYS\n\x11Assistant\nHi\n\x11User\nYo\n\x11Assistant\nOk\n\x11", ["Ok\n\x11"]),
]


@pytest.mark.parametrize("record, text, spans", CHAT_CASES)
def test_chat_dataset_follows_nemo(record, text, spans):
    ds = GPTSFTChatDataset("c.jsonl", ByteTokenizer(), 256, records=records(record))
    s = ds[0]
    assert bytes(s["input_ids"]).decode() == text
    assert _trained_spans(ds, s) == spans
    batch = collate_sft([s], ds.tokenizer.eos_id, 256)
    assert batch["loss_mask"].sum() == sum(map(len, spans))  # no EOS


def test_chat_dataset_refuses_what_nemo_refuses():
    def build(record):
        return GPTSFTChatDataset("c.jsonl", TOK, 128, records=records(record))

    with pytest.raises(DataError, match=r"c\.jsonl:1: conversations\[0\] must be an object"):
        build({"conversations": ["hi"]})
    with pytest.raises(DataError, match=r"c\.jsonl:1: the masked role 'User' .* speaks no turn"):
        build({"system": "", "conversations": [{"from": "Human", "value": "a"}, {"from": "Bot", "value": "b"}]})
    with pytest.raises(DataError, match=r"c\.jsonl:1: field 'type' must be VALUE_TO_TEXT or TEXT_TO_VALUE"):
        build({"system": "", "type": "SOMETHING", "conversations": [{"from": "User", "value": "a"}]})
    with pytest.raises(DataError, match=r"c\.jsonl:1: no token to train on"):
        build({"system": "", "conversations": [{"from": "User", "value": "a"}]})._sample(0)
    # several masked roles, comma-separated: both must speak; neither is trained
    ds = build({"system": "", "mask": "User,Tool", "conversations": [
        {"from": "User", "value": "a"}, {"from": "Assistant", "value": "b"}, {"from": "Tool", "value": "c"},
        {"from": "Assistant", "value": "d"}]})
    assert _trained_spans(ds, ds[0]) == ["b\n\x11", "d\n\x11"]


def test_padding_sample_carries_no_loss():
    ds = GPTSFTDataset("x.jsonl", TOK, 64, records=records({"input": "a =", "output": "b"}))
    batch = collate_sft([ds[0], ds[-1]], TOK.eos_id, 64)
    assert batch["loss_mask"][1].sum() == 0 and batch["lengths"][1] == 0


def test_sampler_splits_global_batches_across_dp_and_resumes():
    samplers = [GlobalBatchSampler(20, 8, rank, 2, shuffle=True, seed=5) for rank in range(2)]
    batches = [list(s) for s in samplers]
    assert len(batches[0]) == 2  # drop_last: 20 // 8
    for step in range(2):
        assert len(batches[0][step]) == 4
        assert not set(batches[0][step]) & set(batches[1][step])
    # Resuming at consumed_samples=8 yields exactly the rest of the epoch.
    resumed = GlobalBatchSampler(20, 8, 0, 2, shuffle=True, seed=5, consumed_samples=8)
    assert list(resumed) == batches[0][1:]
    # The next epoch is a different permutation, the same for every run.
    nxt = GlobalBatchSampler(20, 8, 0, 2, shuffle=True, seed=5, consumed_samples=16)
    again = GlobalBatchSampler(20, 8, 0, 2, shuffle=True, seed=5, consumed_samples=16)
    assert list(nxt) == list(again) and list(nxt) != batches[0]


def test_sampler_pads_last_validation_batch():
    sampler = GlobalBatchSampler(10, 8, 0, 1, shuffle=False, drop_last=False)
    batches = list(sampler)
    assert batches[0] == list(range(8)) and batches[1] == [8, 9, -1, -1, -1, -1, -1, -1]
    with pytest.raises(ConfigError, match="global_batch_size=8 is not divisible by the data-parallel size 3"):
        GlobalBatchSampler(10, 8, 0, 3)
    with pytest.raises(ConfigError, match="larger than the dataset"):
        GlobalBatchSampler(4, 8, 0, 1)


def test_builtin_task_is_deterministic_and_scored():
    task = BuiltinTask(seed=0)
    assert task.examples(5) == BuiltinTask(seed=0).examples(5)
    assert task.examples(5) != BuiltinTask(seed=1).examples(5)
    inp, out = task.examples(1)[0]
    prompt = task.prompt_text(inp)
    assert task.score(prompt, out) == 1.0
    assert task.score("reverse abcd = ", "dcba") == 1.0
    assert task.score("reverse abcd = ", "dcbx") == 0.75
    assert task.score("sort dcba = ", "abcdzz") == pytest.approx(4 / 6)
    assert task.score("sort dcba = ", "") == 0.0
    for foreign in ("\x00", "flip abc = ", "sort = ", ""):  # a reward_fn run on another data set's prompts
        with pytest.raises(DataError, match=r"is not a built-in task prompt \('reverse\|sort <word> = '\): its "
                                            r"reward scores only its own prompts"):
            task.score(foreign, "abc")
    import random

    rng = random.Random(0)
    for i, o in task.examples(200):
        assert task.score(task.prompt_text(i), task.corrupt(o, rng)) < 1.0


def test_labelled_comparisons_rank_the_policys_answers_by_the_rule():
    samples = [{"prompt": "reverse abcd = ", "response": r} for r in ("dcbx\n", "dcba", "dcbx", "xxxx", "", "dcba junk")]
    samples.append({"prompt": "sort ba = ", "response": "ab"})  # only the right answer: no pair
    records = BuiltinTask.labelled_comparison_records(samples, max_pairs_per_prompt=10)
    pairs = [(records[i]["text"], records[i + 1]["text"]) for i in range(0, len(records), 2)]
    # distinct answers dcba (1.0, also the truth), dcbx (0.75), xxxx (0.0), "" (0.0): the pairs of different scores
    expected = {("dcba", "dcbx"), ("dcba", "xxxx"), ("dcba", ""), ("dcbx", "xxxx"), ("dcbx", "")}
    assert {(a.removeprefix("reverse abcd = "), b.removeprefix("reverse abcd = ")) for a, b in pairs} == expected
    assert len(pairs) == len(expected)
    for better, worse in pairs:
        prompt = "reverse abcd = "
        assert BuiltinTask.score(prompt, better[len(prompt):]) > BuiltinTask.score(prompt, worse[len(prompt):])
    # the cap, and the right answer joins even when the policy never gave it
    capped = BuiltinTask.labelled_comparison_records([{"prompt": "sort dcba = ", "response": "abdc"}], max_pairs_per_prompt=1)
    assert capped == [{"text": "sort dcba = abcd"}, {"text": "sort dcba = abdc"}]
    assert len(BuiltinTask.labelled_comparison_records(samples, max_pairs_per_prompt=2)) == 4
    for bad, message in (([{"prompt": "reverse abc = "}], "samples:1: needs string fields"),
                         ([{"prompt": "flip abc = ", "response": "cba", "__file__": "s.jsonl", "__line__": 3}],
                          "s.jsonl:3: prompt 'flip abc = ' is not a built-in task prompt"),
                         (["cba"], "sample 1: a record")):
        with pytest.raises(DataError, match=message):
            BuiltinTask.labelled_comparison_records(bad)


def test_scored_records_label_each_answer_by_the_rule():
    task = BuiltinTask(seed=3)
    records = task.scored_records(50, "train", answers_per_prompt=4)
    assert len(records) == 250  # the right answer and four others per prompt
    labels = []
    for start in range(0, len(records), 5):
        group = records[start:start + 5]
        prompt = group[0]["text"].split("= ")[0] + "= "
        answers = [r["text"][len(prompt):] for r in group]
        assert all(r["text"].startswith(prompt) for r in group)
        assert answers[0] == task.target(prompt) and group[0]["label"] == 4.0
        assert len(set(answers)) == 5  # distinct
        for r, a in zip(group[1:], answers[1:]):
            assert r["label"] == 4 * task.score(prompt, a) < 4.0
            labels.append(r["label"])
    # wrong answers span the scale: some near misses, some with nothing right, and lengths vary
    assert min(labels) == 0.0 and max(labels) >= 3.0 and len(set(labels)) >= 8
    lengths = {len(r["text"].split("= ")[1]) - len(task.target(r["text"].split("= ")[0] + "= ")) for r in records}
    assert {-2, -1, 0, 1, 2} <= lengths
    assert records == task.scored_records(50, "train", answers_per_prompt=4)  # deterministic


def test_labelled_score_records_keep_the_policys_responses():
    samples = [{"prompt": "reverse abcd = ", "response": r} for r in ("dcba", "dcbx", "dcba junk", "")]
    records = BuiltinTask.labelled_score_records(samples + [{"prompt": "sort ba = ", "response": "ba"}])
    assert records == [{"text": "reverse abcd = dcba", "label": 4.0}, {"text": "reverse abcd = dcbx", "label": 3.0},
                       {"text": "reverse abcd = dcba junk", "label": 4.0}, {"text": "reverse abcd = ", "label": 0.0},
                       {"text": "sort ba = ba", "label": 0.0}]
    with pytest.raises(DataError, match="s.jsonl:2: prompt 'flip abc = ' is not a built-in task prompt"):
        BuiltinTask.labelled_score_records([{"prompt": "flip abc = ", "response": "cba", "__file__": "s.jsonl",
                                             "__line__": 2}])


def test_builtin_task_writes_every_format(tmp_path):
    from nemo_aligner.data.nlp.jsonl import read_jsonl

    paths = BuiltinTask(seed=0).write_all(str(tmp_path), n_train=10, n_val=4)
    rm = read_jsonl(paths["rm_train"])
    assert len(rm) == 20
    for chosen, rejected in zip(rm[::2], rm[1::2]):
        prompt = chosen["text"].split("= ")[0]
        assert rejected["text"].startswith(prompt)
        assert BuiltinTask.score(prompt + "= ", chosen["text"].split("= ")[1]) == 1.0
    dpo = read_jsonl(paths["dpo_val"])
    assert len(dpo) == 4 and set(dpo[0]) >= {"prompt", "chosen_response", "rejected_response"}
    assert all(r["text"].endswith("= ") for r in read_jsonl(paths["prompts_train"]))
    assert all(r["label"].startswith("quality:") for r in read_jsonl(paths["regression_train"]))


def write_jsonl_text(path, text):
    path.write_text(text, encoding="utf-8")
    return str(path)


def test_dpo_pair_without_a_prompt_is_trained_from_its_second_token(tmp_path):
    """An empty prompt: nothing predicts the response's first token, so the loss covers the rest of
    the response (it used to cover nothing: the mask started at position -1)."""
    from nemo_aligner.data.nlp.dpo_dataset import DPOPairDataset, collate_dpo

    path = write_jsonl_text(tmp_path / "dpo.jsonl", '{"prompt": "", "chosen_response": "abc", "rejected_response": "de"}\n'
                                                    '{"prompt": "p =", "chosen_response": "x", "rejected_response": "yz"}\n')
    dataset = DPOPairDataset(path, ByteTokenizer(), 32)
    batch = collate_dpo([dataset[0], dataset[1]], pad_id=2, seq_length=32, pad_to_multiple_of=1)
    # row 0: "abc" + EOS = 4 tokens, positions 0..2 predict b, c, EOS; "de" + EOS: d predicts e, e predicts EOS
    assert batch["chosen_mask"][0].tolist()[:4] == [1.0, 1.0, 1.0, 0.0]
    assert batch["rejected_mask"][0].tolist()[:3] == [1.0, 1.0, 0.0]
    # row 1: prompt "p =" (3 tokens): position 2 predicts the first response token
    assert batch["chosen_mask"][1].tolist()[:5] == [0.0, 0.0, 1.0, 1.0, 0.0]
    assert batch["chosen_mask"].sum(dim=1).tolist() == [3.0, 2.0]


def test_byte_order_mark_is_skipped(tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"input": "a =", "output": "b"}\n')
    dataset = GPTSFTDataset(str(path), ByteTokenizer(), 32)
    assert dataset.records[0]["input"] == "a ="


def test_chat_errors_name_the_file_the_record_came_from(tmp_path):
    good = write_jsonl_text(tmp_path / "good.jsonl", '{"conversations": [{"from": "User", "value": "hi"}, '
                                                     '{"from": "Assistant", "value": "yo"}]}\n')
    bad = write_jsonl_text(tmp_path / "bad.jsonl", '{"conversations": [{"from": "User", "value": "hi"}]}\n'
                                                   '{"conversations": ["hi"]}\n')
    from nemo_aligner.data.nlp.jsonl import read_jsonl_files

    records = read_jsonl_files([good, bad], "model.data.train_ds.file_path")
    with pytest.raises(DataError, match=r"^" + bad.replace(".", r"\.") + r":2: conversations\[0\] must be an object"):
        GPTSFTChatDataset(f"{good},{bad}", ByteTokenizer(), 32, records=records)


def test_suspicious_but_valid_records_are_warned_about_by_file_and_line(tmp_path, caplog):
    """Records that load but cannot teach what they seem to: preference pairs with identical responses,
    and over-long DPO/KTO samples (cut to fit). One warning each, naming the first file:line. (A chat
    whose turns never match the masked role is refused, as NeMo does.)"""
    import logging

    from nemo_aligner.data.nlp.dpo_dataset import DPOPairDataset
    from nemo_aligner.data.nlp.kto_dataset import KTODataset
    from nemo_aligner.data.nlp.reward_datasets import RewardComparisonDataset

    dpo = write_jsonl_text(tmp_path / "dpo.jsonl", '{"prompt": "p", "chosen_response": "a", "rejected_response": "b"}\n'
                                                   '{"prompt": "q", "chosen_response": "same", "rejected_response": "same"}\n'
                                                   '{"prompt": "' + "x" * 40 + '", "chosen_response": "a", '
                                                   '"rejected_response": "b"}\n')
    rm = write_jsonl_text(tmp_path / "rm.jsonl", '{"text": "reverse abc = cba"}\n{"text": "reverse abc = cba"}\n')
    kto = write_jsonl_text(tmp_path / "kto.jsonl", '{"prompt": "p", "response": "a", "preference": "chosen"}\n'
                                                   '{"prompt": "' + "y" * 40 + '", "response": "b", "preference": "rejected"}\n')
    with caplog.at_level(logging.WARNING):
        dpo_dataset = DPOPairDataset(dpo, ByteTokenizer(), 32)
        RewardComparisonDataset(rm, ByteTokenizer(), 32)
        kto_dataset = KTODataset(kto, ByteTokenizer(), 32)
        samples = [dpo_dataset[i] for i in range(3)] + [kto_dataset[i] for i in range(2)]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    expected = [f"{dpo}:2: the chosen and rejected responses are identical",
                f"{rm}:2: the chosen and rejected responses are identical",
                f"{dpo}: 1 of 3 samples are longer than the sequence length 32", f"{kto}: 1 of 2 samples are longer"]
    for start in expected:
        assert sum(w.startswith(start) for w in warnings) == 1, (start, warnings)
    assert len(warnings) == len(expected), warnings
    assert any(f"first: {dpo}:3, 9 tokens over" in w for w in warnings)
    assert any(f"first: {kto}:2, 9 tokens over" in w for w in warnings)
    assert len(samples[2]["chosen"]) == 33 and samples[2]["chosen_prompt"] == 31  # the prompt cut from the left


def test_over_long_samples_are_counted_once_and_all_empty_data_is_refused(tmp_path, caplog):
    """Every sample is measured when the dataset is built: the count of truncated samples and the first
    file:line are logged once; a file in which no sample keeps a trained token stops the run."""
    import logging

    from omegaconf import OmegaConf

    from nemo_aligner.data.nlp.builders import build_sft_dataset
    from nemo_aligner.utils.errors import DataError

    path = tmp_path / "sft.jsonl"
    rows = [{"input": "q" * 5, "output": "short"}, {"input": "x" * 40, "output": "y" * 3},
            {"input": "z" * 50, "output": "w"}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n", encoding="utf-8")
    ds_cfg = OmegaConf.create({"file_path": str(path)})
    with caplog.at_level(logging.WARNING):
        dataset = build_sft_dataset(ds_cfg, TOK, 16, chat=False, answer_only_loss=True)
        for i in range(len(dataset)):
            dataset[i]
    messages = [r.getMessage() for r in caplog.records if "longer than" in r.getMessage()]
    assert len(messages) == 1 and "2 of 3 samples" in messages[0] and f"{path}:2" in messages[0]

    chat = tmp_path / "chat.jsonl"
    turns = {"system": "s" * 30, "mask": "User",
             "conversations": [{"from": "User", "value": "hi"}, {"from": "Assistant", "value": "hello"}]}
    chat.write_text(json.dumps(turns) + "\n", encoding="utf-8")
    with pytest.raises(DataError, match=r"every one of the 1 samples is left with no trained token at max_seq_length=16"):
        build_sft_dataset(OmegaConf.create({"file_path": str(chat)}), TOK, 16, chat=True, answer_only_loss=True)


def test_preference_and_reward_datasets_count_their_truncations(caplog):
    import logging

    from nemo_aligner.data.nlp.dpo_dataset import DPOPairDataset
    from nemo_aligner.data.nlp.reward_datasets import RewardComparisonDataset

    pairs = records({"text": "prompt: " + "a" * 40}, {"text": "prompt: b"}, {"text": "prompt: c"},
                    {"text": "prompt: d"}, {"text": "prompt: " + "e" * 30}, {"text": "prompt: f"})
    dpo = records({"prompt": "p" * 30, "chosen_response": "yes", "rejected_response": "no"},
                  {"prompt": "q", "chosen_response": "yes", "rejected_response": "no"})
    with caplog.at_level(logging.WARNING):
        RewardComparisonDataset("rm.jsonl", TOK, 16, records=[dict(r, __file__="rm.jsonl") for r in pairs])
        DPOPairDataset("dpo.jsonl", TOK, 16, records=[dict(r, __file__="dpo.jsonl") for r in dpo])
    messages = [r.getMessage() for r in caplog.records if "longer than the sequence length" in r.getMessage()]
    assert any("rm.jsonl: 2 of 3 comparison pairs are longer than the sequence length 16 and are skipped" in m
               and "first: rm.jsonl:1" in m for m in messages), messages
    assert any("dpo.jsonl: 1 of 2 samples" in m and "first: dpo.jsonl:1" in m for m in messages), messages


def test_sampled_dataset_draws_whole_passes_in_seeded_orders():
    """NeMo's ``model.data.sample=True``: 50 draws from 20 records take every record 2 or 3 times (two
    whole passes, then 10 of a third), each pass in its own order; the seed fixes the draws."""
    import pickle

    from nemo_aligner.data.nlp.builders import SampledDataset

    rows = records(*({"input": f"q{i}", "output": f"a{i}"} for i in range(20)))
    base = GPTSFTDataset("x.jsonl", TOK, 64, records=rows)
    sampled = SampledDataset(base, 50, seed=3)
    assert len(sampled) == 50
    drawn = [sampled.indices[i].item() for i in range(50)]
    assert sorted(drawn[:20]) == list(range(20)) and sorted(drawn[20:40]) == list(range(20))
    assert len(set(drawn[40:])) == 10 and drawn[:20] != drawn[20:40] and drawn[:20] != list(range(20))
    counts = [drawn.count(i) for i in range(20)]
    assert set(counts) == {2, 3} and sum(counts) == 50
    assert sampled[5]["input_ids"] == base[drawn[5]]["input_ids"]
    assert drawn == SampledDataset(base, 50, seed=3).indices.tolist() != SampledDataset(base, 50, seed=4).indices.tolist()
    # fewer draws than records: a random part, no repeats
    part = SampledDataset(base, 8, seed=3).indices.tolist()
    assert len(set(part)) == 8 and part != list(range(8))
    # the wrapped dataset's attributes, and a copy for a worker process
    assert sampled.tokenizer is base.tokenizer
    assert pickle.loads(pickle.dumps(sampled)).indices.tolist() == drawn
    with pytest.raises(ConfigError, match="model.data.train_ds: no records to sample 4 from"):
        SampledDataset([], 4, seed=0)


@pytest.mark.parametrize("limit,expected", [(5, 40), (5.0, 40), (2.5, 16), (1.0, 20), (0.5, 20), (-1, 20), (None, 20)])
def test_sampled_validation_takes_limit_val_batches_global_batches(limit, expected):
    """``model.data.sample=True`` draws ``limit_val_batches`` x the validation global batch (8) records,
    as NeMo-Aligner's scripts do; a fraction, -1 or no limit keep the 20 records as they are; without
    ``sample`` nothing changes."""
    from omegaconf import OmegaConf

    from nemo_aligner.recipes.run_helpers import sample_validation

    base = list(range(20))
    cfg = OmegaConf.create({"model": {"data": {"sample": True}}, "trainer": {"sft": {"limit_val_batches": limit}}})
    assert len(sample_validation(base, cfg, "sft", 8, seed=0)) == expected
    cfg.model.data.sample = False
    assert sample_validation(base, cfg, "sft", 8, seed=0) is base
