""".nemo files and training checkpoints: layout, resharding on load, atomic writes, shape errors."""

import json
import os
import re
import tarfile

import pytest
import torch
import yaml
from omegaconf import OmegaConf

from conftest import TINY_ARCH, WORKERS, run_python

WORKER = os.path.join(WORKERS, "parallel_loss_worker.py")


def tiny_model(**overrides):
    from nemo_aligner.models.nlp.gpt.gpt_sft_model import GPTSFTModel
    from nemo_aligner.utils.tokenizers import ByteTokenizer

    cfg = OmegaConf.create(dict(TINY_ARCH, micro_batch_size=2, encoder_seq_length=32, **overrides))
    return GPTSFTModel(cfg, ByteTokenizer())


def test_nemo_file_layout(base_nemo):
    nemo, _ = base_nemo
    assert tarfile.is_tarfile(nemo)
    with tarfile.open(nemo, "r:") as tar:  # "r:" fails on a compressed archive
        names = {m.name.lstrip("./") for m in tar.getmembers()}
        config = yaml.safe_load(tar.extractfile("./model_config.yaml").read())
        common = tar.extractfile("./model_weights/metadata.json").read()
    assert "model_config.yaml" in names
    assert {"model_weights/metadata.json", "model_weights/common.pt", "model_weights/.metadata"} <= names
    assert any(n.startswith("model_weights/__") and n.endswith(".distcp") for n in names)
    assert json.loads(common)["sharded_backend"] == "torch_dist"
    assert config["mcore_gpt"] is True and config["dist_ckpt_format"] == "torch_dist"
    assert config["num_layers"] == 2 and config["hidden_size"] == 64
    assert config["tokenizer"]["library"] == "byte-level"  # NeMo's name; pad 256, bos 257, eos 258 as NeMo 1.x


def test_nemo_keys_use_megatron_core_names(base_nemo, mcore_single):
    from nemo_aligner.utils import nemo_file
    from nemo_aligner.utils.checkpoint_io import checkpoint_shapes

    nemo, _ = base_nemo
    with nemo_file.extracted(nemo) as directory:
        meta = checkpoint_shapes(nemo_file.weights_dir(directory))
    qkv = meta["model.decoder.layers.self_attention.linear_qkv.weight"]
    # Stacked over layers: [num_layers, hidden + 2 * query_groups * head_dim, hidden] (GQA: 2 groups of 16)
    assert qkv == (2, 64 + 2 * 2 * 16, 64)
    assert "model.embedding.word_embeddings.weight" in meta
    assert "model.output_layer.weight" in meta


def test_save_tp2_load_tp1_and_pp2(tmp_path, base_nemo):
    nemo, reference = base_nemo
    tp2_nemo = str(tmp_path / "tp2.nemo")
    run_python(WORKER, ["--nemo", nemo, "--tp", "2", "--save", tp2_nemo, "--out", tmp_path / "a.json"], nproc=2)
    for tag, args, nproc in (("tp1", [], 1), ("pp2", ["--pp", "2"], 2)):
        out = tmp_path / f"{tag}.json"
        run_python(WORKER, ["--nemo", tp2_nemo, "--out", out, *args], nproc=nproc)
        result = json.loads(out.read_text())
        assert result["loss0"] == pytest.approx(reference["loss0"], rel=1e-6), tag
        assert result["loss1"] == pytest.approx(reference["loss1"], rel=2e-5), tag


@pytest.mark.stack
def test_save_load_round_trip_in_process(tmp_path, mcore_single):
    from nemo_aligner.models.nlp.gpt.gpt_sft_model import GPTSFTModel
    from nemo_aligner.models.nlp.gpt.loading import load_model
    from nemo_aligner.utils.nemo_file import save_nemo

    torch.manual_seed(3)
    model = tiny_model()
    path = save_nemo(model, str(tmp_path / "m.nemo"))
    assert not os.path.exists(path + ".tmp") and not os.path.exists(path + ".tmpdir")
    restored = load_model(GPTSFTModel, OmegaConf.create({"micro_batch_size": 2}), "32", path)
    for (name, a), (_, b) in zip(model.module.state_dict().items(), restored.module.state_dict().items()):
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, b), name
    # The restored config keeps the architecture and the padded vocabulary.
    assert restored.cfg.hidden_size == 64 and restored.cfg.padded_vocab_size == model.cfg.padded_vocab_size


def test_extra_state_the_checkpoint_lacks_is_left_to_the_module(tmp_path, mcore_single):
    """A model with a module state the writing spec does not store (Transformer Engine's attention keeps
    an ``_extra_state``; the local spec's has none) loads the checkpoint; its weights are the saved ones."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    from nemo_aligner.utils import nemo_file
    from nemo_aligner.utils.nemo_file import save_nemo

    torch.manual_seed(5)
    saved = tiny_model()
    path = save_nemo(saved, str(tmp_path / "m.nemo"))
    reader = tiny_model()
    own = reader.sharded_state_dict

    def with_attention_state(*args, **kwargs):
        state = own(*args, **kwargs)
        state["model.decoder.layers.self_attention.core_attention._extra_state"] = ShardedObject(
            "model.decoder.layers.self_attention.core_attention._extra_state", None, (1,), (0,), replica_id=0)
        return state

    reader.sharded_state_dict = with_attention_state
    with nemo_file.extracted(path) as directory:
        reader.load_weights(nemo_file.weights_dir(directory), what="model.restore_from_path")
    for (name, a), (_, b) in zip(saved.module.state_dict().items(), reader.module.state_dict().items()):
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, b), name


def test_wrong_shape_checkpoint_is_named(tmp_path, mcore_single):
    from nemo_aligner.utils.errors import CheckpointError
    from nemo_aligner.utils.nemo_file import save_nemo

    path = save_nemo(tiny_model(), str(tmp_path / "m.nemo"))
    other = tiny_model(ffn_hidden_size=96)
    from nemo_aligner.utils import nemo_file

    with nemo_file.extracted(path) as directory:
        with pytest.raises(CheckpointError, match=r"linear_fc[12].weight. has shape .* in the checkpoint but .*96"):
            other.load_weights(nemo_file.weights_dir(directory), what="model.restore_from_path")


@pytest.mark.stack
def test_interrupted_save_keeps_previous_checkpoint(tmp_path, mcore_single):
    from nemo_aligner.utils.checkpoint_callback import latest_checkpoint
    from nemo_aligner.utils.train_checkpoint import read_trainer_state, save_train_checkpoint

    model = tiny_model(optim={"name": "fused_adam", "lr": 1e-3})
    optimizer, scheduler = model.setup_optimization(max_steps=10)
    good = str(tmp_path / "ckpt-step=1")
    save_train_checkpoint(good, model, optimizer, scheduler, {"step": 1, "consumed_samples": 8})

    # A second save to the same name dies half-way (after the tensors, before the rename).
    import nemo_aligner.utils.train_checkpoint as tc

    original = tc.save_sharded

    def dying_save(sharded, directory, before_commit=None):
        def crash(tmp_dir):
            raise KeyboardInterrupt("killed while saving")
        original(sharded, directory, before_commit=crash)

    tc.save_sharded = dying_save
    try:
        with pytest.raises(KeyboardInterrupt):
            save_train_checkpoint(good, model, optimizer, scheduler, {"step": 2, "consumed_samples": 16})
    finally:
        tc.save_sharded = original
    assert os.path.isdir(good + ".tmp")  # the partial write is left under its temporary name
    assert read_trainer_state(good)["step"] == 1
    assert latest_checkpoint(str(tmp_path)) == good


def make_hf_tokenizer(directory):
    """A tiny word-level Hugging Face tokenizer built locally (no download)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<unk>", "<s>", "</s>", "reverse", "sort", "=", "abc", "cba"])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    tok.save_pretrained(directory)
    return directory


def test_hf_tokenizer_travels_inside_the_nemo(tmp_path, mcore_single):
    from nemo_aligner.models.nlp.gpt.gpt_sft_model import GPTSFTModel
    from nemo_aligner.models.nlp.gpt.loading import load_model
    from nemo_aligner.utils.nemo_file import list_members, read_model_config, save_nemo

    tok_dir = make_hf_tokenizer(str(tmp_path / "tok"))
    cfg = OmegaConf.create(dict(TINY_ARCH, micro_batch_size=2, encoder_seq_length=32,
                                tokenizer={"library": "huggingface", "type": tok_dir}))
    model = load_model(GPTSFTModel, cfg, "32")
    ids = model.tokenizer.text_to_ids("reverse abc = cba")
    assert ids == [3, 6, 5, 7]
    path = save_nemo(model, str(tmp_path / "hf.nemo"))
    import shutil

    shutil.rmtree(tok_dir)  # the .nemo must not depend on the original directory
    config = read_model_config(path)
    refs = list(config.tokenizer.files)
    assert refs and all(r.startswith("nemo:") for r in refs)
    members = list_members(path)
    assert all(r[len("nemo:"):] in members for r in refs)
    assert any(r.endswith("_tokenizer.json") for r in refs)
    restored = load_model(GPTSFTModel, OmegaConf.create({"micro_batch_size": 2}), "32", path)
    assert restored.tokenizer.text_to_ids("reverse abc = cba") == ids
    assert restored.tokenizer.eos_id == 2

    # the packed tokenizer.json damaged: one line naming the .nemo and the library's complaint
    import io

    from nemo_aligner.utils.errors import CheckpointError
    from nemo_aligner.utils.nemo_file import load_tokenizer

    damaged = str(tmp_path / "damaged.nemo")
    with tarfile.open(path, "r:") as src, tarfile.open(damaged, "w:") as dst:
        for member in src.getmembers():
            data = src.extractfile(member).read() if member.isfile() else None
            if member.name.endswith("_tokenizer.json"):
                data = b'{"truncated": '
                member.size = len(data)
            dst.addfile(member, io.BytesIO(data) if data is not None else None)
    for load in (lambda: load_model(GPTSFTModel, OmegaConf.create({"micro_batch_size": 2}), "32", damaged),
                 lambda: load_tokenizer(damaged)):
        with pytest.raises(CheckpointError) as refusal:
            load()
        message = str(refusal.value)
        # the library's complaint: JSONDecodeError from transformers 5, the tokenizers library's Exception from 4
        assert damaged in message and re.search(r"the tokenizer files cannot be read \((JSONDecodeError|Exception): "
                                                r".*(line 1 column|char 1)", message), message
        assert "\n" not in message


def test_tokenizer_files_a_library_cannot_read_are_named(tmp_path):
    """Damaged SentencePiece, GPT-2 BPE and Hugging Face tokenizer files: a CheckpointError naming the
    files, not the tokenizer library's traceback."""
    from nemo_aligner.utils.errors import CheckpointError
    from nemo_aligner.utils.tokenizers import build_tokenizer

    junk = tmp_path / "junk.model"
    junk.write_bytes(b"\x00\xffnot a model")
    merges = tmp_path / "merges.txt"
    merges.write_text("#version: 0.2\n")
    hf_dir = make_hf_tokenizer(str(tmp_path / "hf"))
    (tmp_path / "hf" / "tokenizer.json").write_text("[1, 2]")
    for cfg, named in (({"library": "sentencepiece", "model": str(junk)}, str(junk)),
                       ({"library": "megatron", "type": "GPT2BPETokenizer", "vocab_file": str(junk),
                         "merge_file": str(merges)}, f"{junk}, {merges}"),
                       ({"library": "huggingface", "type": hf_dir}, hf_dir)):
        with pytest.raises(CheckpointError) as refusal:
            build_tokenizer(cfg)
        message = str(refusal.value)
        assert message.startswith(f"model.tokenizer (library {cfg['library']!r}, {named}): the tokenizer files "
                                  "cannot be read ("), message
        assert "\n" not in message


def test_interrupted_saves_are_tidied_before_resuming(tmp_path):
    """A kill mid-save leaves ``<name>.tmp`` (never committed: removed) or, during the final swap,
    ``<name>.old.<pid>`` without ``<name>`` (the previous version: put back)."""
    from nemo_aligner.utils.checkpoint_io import recover_interrupted_saves

    for name in ("step=3.tmp", "step=2.old.77", "step=1", "step=1.old.12", "model.nemo.tmpdir"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "trainer_state.json").write_text(json.dumps({"name": name}))
    (tmp_path / "model.nemo.tmp").write_bytes(b"half a tar")  # save_nemo's tar, killed before its rename
    (tmp_path / "model.nemo").write_bytes(b"the previous .nemo")
    recover_interrupted_saves(str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == ["model.nemo", "step=1", "step=2"]
    assert json.loads((tmp_path / "step=2" / "trainer_state.json").read_text()) == {"name": "step=2.old.77"}
    assert json.loads((tmp_path / "step=1" / "trainer_state.json").read_text()) == {"name": "step=1"}


def test_a_prune_killed_midway_leaves_no_half_deleted_checkpoint(tmp_path, monkeypatch):
    """Pruning a checkpoint that fell out of the top k, killed after its shard file is gone but
    before its metadata is: no checkpoint listed for resuming lacks a file, and the remains are
    removed before the next resume (CI once caught a kill -9 landing exactly there)."""
    from nemo_aligner.utils import checkpoint_io
    from nemo_aligner.utils.checkpoint_callback import CheckpointCallback, latest_checkpoint, list_checkpoints
    from nemo_aligner.utils.checkpoint_io import recover_interrupted_saves

    for step in (2, 4, 6):
        d = tmp_path / f"ck-step={step}"
        d.mkdir()
        (d / "__0_0.distcp").write_bytes(b"shard")
        (d / "metadata.json").write_text("{}")
        (d / "trainer_state.json").write_text(json.dumps({"step": step, "monitor_value": None}))

    class Killed(BaseException):
        pass

    def rmtree_killed_midway(path, ignore_errors=False):
        os.remove(os.path.join(path, "__0_0.distcp"))  # what rmtree deletes first, then the kill
        raise Killed

    cb = CheckpointCallback(str(tmp_path), "ck-{step}", monitor="val_loss", mode="min", save_top_k=2)
    with monkeypatch.context() as patch:
        patch.setattr(checkpoint_io.shutil, "rmtree", rmtree_killed_midway)
        with pytest.raises(Killed):
            cb.prune()
    listed = [path for path, _ in list_checkpoints(str(tmp_path))]
    assert sorted(os.path.basename(p) for p in listed) == ["ck-step=4", "ck-step=6"]
    assert all(os.path.isfile(os.path.join(p, "__0_0.distcp")) for p in listed)
    assert latest_checkpoint(str(tmp_path)).endswith("ck-step=6")
    recover_interrupted_saves(str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == ["ck-step=4", "ck-step=6"]


def test_the_end_of_training_writes_the_nemo_unless_always_save_nemo_already_did(tmp_path, monkeypatch):
    """save_nemo_on_train_end skips its write only when always_save_nemo's .nemo holds the weights it
    would write (the checkpoint saved at the last step, or the best one) and the file is still there."""
    from types import SimpleNamespace

    from nemo_aligner.recipes.run_helpers import fit_and_export
    from nemo_aligner.utils import checkpoint_callback as cc

    writes = []

    def fake_save_checkpoint(path, model, optimizer, scheduler, state):
        os.makedirs(path)
        (tmp_path / path / "metadata.json").write_text("{}")
        (tmp_path / path / "trainer_state.json").write_text(json.dumps(state))

    def fake_save_nemo(model, path):
        writes.append(path)
        open(path, "w").close()
        return path

    monkeypatch.setattr(cc, "save_train_checkpoint", fake_save_checkpoint)
    monkeypatch.setattr(cc, "save_nemo", fake_save_nemo)

    def run(saved_steps, final_step, metrics=None, remove_nemo=False, always=True, **params):
        directory = tmp_path / f"run{len(os.listdir(tmp_path))}"
        callback = cc.CheckpointCallback(str(directory), "ck-{step}", monitor="val_loss", mode="min",
                                         save_top_k=-1, always_save_nemo=always, **params)
        model = SimpleNamespace(load_weights=lambda path, what: None)
        for step in saved_steps:
            callback.save(model, None, None, {"step": step}, (metrics or {}).get(step, {}))
        if remove_nemo:
            os.remove(callback.nemo_path)
        assert os.path.isfile(callback.nemo_path) == (always and not remove_nemo and bool(writes))
        writes.clear()
        trainer = SimpleNamespace(step=final_step, max_steps=final_step, fit=lambda: {}, load_checkpoint=None,
                                  timer=SimpleNamespace(close=lambda: None, stop_reason=None))
        exp = SimpleNamespace(resume_from=None, checkpoint_callback=callback, log_dir=str(directory),
                              logger=SimpleNamespace(finalize=lambda: None))
        summary = fit_and_export(trainer, model, exp)
        assert summary["nemo_path"] == callback.nemo_path and os.path.isfile(callback.nemo_path)
        return len(writes)

    assert run([2, 4], 4) == 0  # the step-4 checkpoint's .nemo is already there
    assert run([2, 4], 5) == 1  # step 5 was not saved: its weights are not in the .nemo
    assert run([2, 4], 4, remove_nemo=True) == 1
    best_first = {2: {"val_loss": 1.0}, 4: {"val_loss": 2.0}}
    assert run([2, 4], 4, best_first, save_best_model=True) == 0  # the .nemo holds step 2, the best
    assert run([2, 4], 4, {4: {"val_loss": 2.0}}, save_best_model=True) == 0
    assert run([2, 4], 4, save_best_model=True) == 1  # no scores: no .nemo yet, the last weights are written
    assert run([2, 4], 4, always=False) == 1  # no always_save_nemo: the end of training is the only writer


def test_an_interrupted_replacement_outside_a_checkpoint_directory_is_tidied(tmp_path):
    """An export (or a demo stage) replaced or deleted by a process that was killed part-way: the
    previous version moved aside comes back when nothing replaced it, is dropped when something
    did; a half-deleted ``.removing`` goes; unrelated neighbours are left alone."""
    from nemo_aligner.utils.checkpoint_io import recover_replaced_dir, remove_dir_atomically

    for name in ("hf.old.41", "other.tmp", "hf-2.old.7", "kept.removing"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(name)
    recover_replaced_dir(str(tmp_path / "hf"))
    assert (tmp_path / "hf" / "config.json").read_text() == "hf.old.41"
    assert sorted(os.listdir(tmp_path)) == ["hf", "hf-2.old.7", "kept.removing", "other.tmp"]
    (tmp_path / "hf.old.42").mkdir()
    (tmp_path / "hf.removing").mkdir()
    recover_replaced_dir(str(tmp_path / "hf"))
    assert sorted(os.listdir(tmp_path)) == ["hf", "hf-2.old.7", "kept.removing", "other.tmp"]
    (tmp_path / "hf.removing").mkdir()  # an earlier deletion of the same name, interrupted
    (tmp_path / "hf.removing" / "half").write_text("x")
    remove_dir_atomically(str(tmp_path / "hf"))
    assert sorted(os.listdir(tmp_path)) == ["hf-2.old.7", "kept.removing", "other.tmp"]


def test_rng_state_written_on_the_other_device_kind_keeps_the_tracker(mcore_single, caplog):
    """A training checkpoint from a GPU run resumed on the CPU (or back): the megatron-core tracker's
    CUDA states do not fit the CPU tracker, so its streams are kept (with a warning) while Python,
    NumPy and torch's generators are restored; from the same kind of device everything is restored."""
    import logging

    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    from nemo_aligner.utils.train_checkpoint import rng_state, set_rng_state

    here = "cuda" if torch.cuda.is_available() else "cpu"
    other = {"cuda": "cpu", "cpu": "cuda"}[here]
    state = rng_state()
    assert state["tracker_device"] == here
    expected = torch.rand(3)
    tracker = get_cuda_rng_tracker()
    kept = {k: v.clone() for k, v in tracker.get_states().items()}
    foreign = dict(state, tracker_device=other, tracker={k: torch.zeros(16, dtype=torch.uint8) for k in kept})
    with caplog.at_level(logging.WARNING, logger="nemo_aligner.utils.train_checkpoint"):
        set_rng_state(foreign)
    assert torch.equal(torch.rand(3), expected)
    assert all(torch.equal(tracker.get_states()[k], v) for k, v in kept.items())
    assert f"written on {other}, resuming on {here}" in caplog.text

    with tracker.fork():
        torch.rand(5, device=here)  # advances the tracker's stream (the CUDA generator's on a GPU)
    assert any(not torch.equal(tracker.get_states()[k], v) for k, v in kept.items())
    set_rng_state(dict(state, tracker=kept))
    assert all(torch.equal(tracker.get_states()[k], v) for k, v in kept.items())


def test_a_damaged_checkpoint_is_an_error_naming_it(tmp_path, mcore_single):
    """A shard file or common.pt missing: a CheckpointError naming the checkpoint and what to do (torch
    DCP's own CheckpointException is a BaseException, which slipped past `except Exception`)."""
    from nemo_aligner.models.nlp.gpt.gpt_sft_model import GPTSFTModel
    from nemo_aligner.utils.checkpoint_io import load_common, load_sharded, save_sharded
    from nemo_aligner.utils.errors import CheckpointError
    from nemo_aligner.utils.tokenizers import ByteTokenizer

    model = GPTSFTModel(OmegaConf.create(dict(TINY_ARCH, micro_batch_size=1, encoder_seq_length=32)), ByteTokenizer())
    ckpt = tmp_path / "step=4"
    save_sharded(model.sharded_state_dict(), str(ckpt))
    for shard in ckpt.glob("*.distcp"):
        shard.unlink()
    with pytest.raises(CheckpointError, match=r"step=4: could not be loaded \(.*\); the checkpoint is damaged or "
                                              r"incomplete: move it aside"):
        load_sharded(model.sharded_state_dict(), str(ckpt))
    (ckpt / "common.pt").unlink()
    with pytest.raises(CheckpointError, match=r"step=4: common\.pt is missing"):
        load_common(str(ckpt))


def test_concurrent_jobs_never_share_an_extraction_directory(tmp_path, monkeypatch):
    """Local rank 0 extracts a .nemo for its job and removes the directory afterwards: two torchrun jobs
    (whose run id is "none" unless given) loading one file must get different directories, while
    the ranks of one job agree on theirs."""
    from nemo_aligner.utils.nemo_file import _extract_dir_for

    nemo = tmp_path / "m.nemo"
    nemo.write_bytes(b"x")
    for key in ("TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT", "SLURM_JOB_ID", "SLURM_STEP_ID"):
        monkeypatch.delenv(key, raising=False)

    def directory(**env):
        with monkeypatch.context() as m:
            for key, value in env.items():
                m.setenv(key, value)
            return _extract_dir_for(str(nemo))

    job_a = directory(TORCHELASTIC_RUN_ID="none", MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")
    job_b = directory(TORCHELASTIC_RUN_ID="none", MASTER_ADDR="127.0.0.1", MASTER_PORT="29501")
    assert job_a != job_b
    assert job_a == directory(TORCHELASTIC_RUN_ID="none", MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")
    assert directory(SLURM_JOB_ID="7", SLURM_STEP_ID="0") != directory(SLURM_JOB_ID="7", SLURM_STEP_ID="1")
    assert directory(TORCHELASTIC_RUN_ID="abc", MASTER_PORT="1") == directory(TORCHELASTIC_RUN_ID="abc", MASTER_PORT="2")


def test_non_finite_weights_are_never_written_or_loaded(tmp_path, mcore_single, monkeypatch):
    """A diverged model (NaN weights) does not replace a good .nemo; a .nemo holding NaN weights (a
    corrupted file, an older writer) is refused on load, naming the tensor."""
    import hashlib

    import torch

    from nemo_aligner.models.nlp.gpt.gpt_sft_model import GPTSFTModel
    from nemo_aligner.models.nlp.gpt.loading import load_model
    from nemo_aligner.utils import nemo_file
    from nemo_aligner.utils.errors import CheckpointError
    from nemo_aligner.utils.tokenizers import ByteTokenizer

    cfg = OmegaConf.create(dict(TINY_ARCH, micro_batch_size=1, encoder_seq_length=32))
    model = GPTSFTModel(cfg, ByteTokenizer())
    path = tmp_path / "m.nemo"
    nemo_file.save_nemo(model, str(path))
    before = hashlib.sha256(path.read_bytes()).hexdigest()
    with torch.no_grad():
        model.module.decoder.layers[1].mlp.linear_fc2.weight[0, 0] = float("nan")
    with pytest.raises(CheckpointError, match=r"m\.nemo: not written, the model's weights are not finite \(tensor "
                                              r"'decoder\.layers\.1\.mlp\.linear_fc2\.weight'"):
        nemo_file.save_nemo(model, str(path))
    assert hashlib.sha256(path.read_bytes()).hexdigest() == before

    from nemo_aligner.utils import checkpoint_io

    monkeypatch.setattr(checkpoint_io, "non_finite_tensor", lambda module: None)  # an unchecked writer
    nemo_file.save_nemo(model, str(tmp_path / "nan.nemo"))
    monkeypatch.undo()
    with pytest.raises(CheckpointError, match=r"nan\.nemo: tensor 'decoder\.layers\.1\.mlp\.linear_fc2\.weight' "
                                              r"holds a NaN or an infinity"):
        load_model(GPTSFTModel, OmegaConf.create({"micro_batch_size": 1}), "32", str(tmp_path / "nan.nemo"))


def test_a_failed_save_or_a_torn_rng_file_is_one_clear_error(tmp_path, mcore_single, monkeypatch):
    """Disk full while saving: a CheckpointError, nothing half-written left, the earlier checkpoint of
    that name intact. A damaged rng_state file: a CheckpointError naming it, not a pickle traceback."""
    import errno

    from megatron.core import dist_checkpointing

    from nemo_aligner.models.nlp.gpt.gpt_sft_model import GPTSFTModel
    from nemo_aligner.utils.errors import CheckpointError
    from nemo_aligner.utils.tokenizers import ByteTokenizer
    from nemo_aligner.utils.train_checkpoint import load_train_checkpoint, save_train_checkpoint

    model = GPTSFTModel(OmegaConf.create(dict(TINY_ARCH, micro_batch_size=1, encoder_seq_length=32)), ByteTokenizer())
    ckpt = tmp_path / "step=2"
    save_train_checkpoint(str(ckpt), model, None, None, {"step": 2})
    before = sorted(os.listdir(ckpt))

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(dist_checkpointing, "save", disk_full)
    with pytest.raises(CheckpointError, match=r"step=2: could not be written \(.*No space left on device\); "
                                              r"nothing was replaced"):
        save_train_checkpoint(str(ckpt), model, None, None, {"step": 2})
    monkeypatch.undo()
    assert sorted(os.listdir(ckpt)) == before and not (tmp_path / "step=2.tmp").exists()

    (ckpt / "rng_state_0.pt").write_bytes(b"PK\x03\x04 torn")
    with pytest.raises(CheckpointError, match=r"step=2: rng_state_0\.pt cannot be read .*move it aside"):
        load_train_checkpoint(str(ckpt), model, None, None)
