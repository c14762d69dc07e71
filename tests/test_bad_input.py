"""Every bad input stops the SFT script with one clear line naming the file and line or the
config key, exit status 1, no traceback, and nothing already written is damaged."""

import os

import pytest

from conftest import run_script

BASE = ["model.encoder_seq_length=32", "model.data.train_ds.micro_batch_size=4",
        "model.data.train_ds.global_batch_size=8", "trainer.sft.max_steps=2", "trainer.sft.val_check_interval=2"]


def run_bad(tmp_path, train, val, extra=(), nproc=1, cpu_only=False):
    """Run the SFT script on a bad input, in a log directory holding an earlier run's files: those
    must come out intact (appended to at most)."""
    log_dir = tmp_path / "logs"
    earlier = {log_dir / "metrics.jsonl": '{"step": 1, "train/loss": 2.5}\n',
               log_dir / "checkpoints" / "notes.txt": "an earlier run's file\n"}
    for path, text in earlier.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    overrides = BASE + [f"model.data.train_ds.file_path={train}", f"model.data.validation_ds.file_path={val}",
                        f"exp_manager.explicit_log_dir={log_dir}", *extra]
    proc = run_script("train_gpt_sft.py", overrides, nproc=nproc, check=False, cpu_only=cpu_only)
    assert proc.returncode != 0, proc.stdout[-2000:]
    for path, text in earlier.items():
        assert path.read_text().startswith(text), path
    return proc


def write(path, text):
    path.write_text(text, encoding="utf-8")
    return path


@pytest.mark.parametrize(
    "content, expected",
    [
        ('{"input": "a =", "output": "b"}\n{"input": "c =", "output": \n', r"bad\.jsonl:2: malformed JSON"),
        ('{"input": "a =", "output": "b"}\n\n{"input": "c ="}\n', r"bad\.jsonl:3: missing field 'output'"),
    ],
    ids=["malformed", "missing-field"],  # the other jsonl cases: tests/test_bad_input_catalogue.py (in process)
)
def test_bad_training_file(tmp_path, builtin_data, content, expected):
    bad = write(tmp_path / "bad.jsonl", content)
    proc = run_bad(tmp_path, bad, builtin_data["sft_val"])
    assert proc.returncode == 1
    import re

    lines = [l for l in proc.stderr.splitlines() if l.startswith("error:")]
    assert len(lines) == 1 and re.search(expected, lines[0]), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("variable", ["NEMO_ALIGNER_DECODE_GEMM", "NEMO_ALIGNER_CPU_KERNELS",
                                      "NEMO_ALIGNER_DECODE_BUFFERS"])
def test_bad_cpu_kernel_setting_is_refused_before_work(tmp_path, builtin_data, monkeypatch, variable):
    """Each is read deep inside the first forward pass or generation; a bad value stops the run at its start."""
    monkeypatch.setenv(variable, "fastest")
    proc = run_bad(tmp_path, builtin_data["sft_train"], builtin_data["sft_val"])
    lines = [l for l in proc.stderr.splitlines() if l.startswith("error:")]
    assert proc.returncode == 1 and len(lines) == 1 and f"{variable}='fastest'" in lines[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "restored weights" not in proc.stderr + proc.stdout


def test_missing_path(tmp_path, builtin_data, base_nemo):
    """Refused before the model is built (its checkpoint is not read)."""
    proc = run_bad(tmp_path, tmp_path / "nope.jsonl", builtin_data["sft_val"],
                   extra=[f"model.restore_from_path={base_nemo[0]}"])
    assert f"error: {tmp_path / 'nope.jsonl'}: file does not exist" in proc.stderr
    assert "restored weights" not in proc.stdout + proc.stderr


def test_missing_restore_path(tmp_path, builtin_data):
    proc = run_bad(tmp_path, builtin_data["sft_train"], builtin_data["sft_val"],
                   [f"model.restore_from_path={tmp_path / 'gone.nemo'}"])
    assert f"error: model.restore_from_path={tmp_path / 'gone.nemo'}: no such file or directory" in proc.stderr


def test_truncated_nemo(tmp_path, builtin_data, base_nemo):
    nemo, _ = base_nemo
    broken = tmp_path / "broken.nemo"
    with open(nemo, "rb") as src:
        broken.write_bytes(src.read()[:5000])
    proc = run_bad(tmp_path, builtin_data["sft_train"], builtin_data["sft_val"], [f"model.restore_from_path={broken}"])
    assert "error: model.restore_from_path=" in proc.stderr and "broken.nemo" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_unknown_config_key(tmp_path, builtin_data):
    proc = run_bad(tmp_path, builtin_data["sft_train"], builtin_data["sft_val"], ["model.optim.lrr=0.1"])
    assert "model.optim.lrr" in proc.stderr and "not in struct" in proc.stderr


def test_world_size_mismatch(tmp_path, builtin_data):
    proc = run_bad(tmp_path, builtin_data["sft_train"], builtin_data["sft_val"], ["trainer.devices=3"], nproc=2)
    assert "error: trainer.devices=3 x trainer.num_nodes=1 = 3 processes, but the launcher started 2" in proc.stderr


def test_tp_does_not_divide_heads(tmp_path, builtin_data):
    proc = run_bad(tmp_path, builtin_data["sft_train"], builtin_data["sft_val"],
                   ["trainer.devices=2", "model.tensor_model_parallel_size=2", "model.num_attention_heads=3",
                    "model.hidden_size=96"], nproc=2)
    assert "model.tensor_model_parallel_size=2 does not divide model.num_attention_heads=3" in proc.stderr


def test_batch_sizes_checked(tmp_path, builtin_data):
    proc = run_bad(tmp_path, builtin_data["sft_train"], builtin_data["sft_val"],
                   ["model.data.train_ds.global_batch_size=6"])
    assert "model.data.train_ds.global_batch_size=6 / data-parallel size 1 is not a multiple of " \
           "model.data.train_ds.micro_batch_size=4" in proc.stderr


def test_sequence_parallel_on_cpu(tmp_path, builtin_data):
    """Refused with tensor parallelism (at TP=1 it is off, as in NeMo: test_model_config.py)."""
    proc = run_bad(tmp_path, builtin_data["sft_train"], builtin_data["sft_val"],
                   ["model.sequence_parallel=True", "trainer.devices=2", "model.tensor_model_parallel_size=2"],
                   nproc=2, cpu_only=True)
    assert "model.sequence_parallel=True needs Transformer Engine on a GPU" in proc.stderr


def test_expert_parallelism_needs_experts(tmp_path, builtin_data):
    """Experts split over ranks: refused for a dense model."""
    proc = run_bad(tmp_path, builtin_data["sft_train"], builtin_data["sft_val"],
                   ["trainer.devices=2", "++model.expert_model_parallel_size=2"], nproc=2)
    assert "model.expert_model_parallel_size=2 needs a mixture-of-experts model (model.num_moe_experts)" in proc.stderr


def test_resume_with_changed_architecture_keeps_checkpoint(tmp_path, builtin_data):
    """A checkpoint of the wrong shape is named, and the checkpoint itself is left as it was."""
    log_dir = tmp_path / "logs"
    common = BASE + [f"model.data.train_ds.file_path={builtin_data['sft_train']}",
                     f"model.data.validation_ds.file_path={builtin_data['sft_val']}",
                     f"exp_manager.explicit_log_dir={log_dir}"]
    run_script("train_gpt_sft.py", common)
    ckpt_dir = log_dir / "checkpoints"
    before = {p: os.path.getsize(os.path.join(r, p)) for r, _, fs in os.walk(ckpt_dir) for p in fs}
    proc = run_script("train_gpt_sft.py", common + ["trainer.sft.max_steps=4", "model.ffn_hidden_size=256"],
                      check=False)
    assert proc.returncode == 1
    assert "error: checkpoint" in proc.stderr and "has shape" in proc.stderr and "architecture" in proc.stderr
    after = {p: os.path.getsize(os.path.join(r, p)) for r, _, fs in os.walk(ckpt_dir) for p in fs}
    assert after == before


def test_a_required_key_left_unset_is_named(tmp_path):
    """A '???' in the yaml that the command line did not fill is one error line naming the key, as a
    ConfigError is (not OmegaConf's traceback)."""
    proc = run_script("train_steerlm_model.py", [f"exp_manager.explicit_log_dir={tmp_path / 'logs'}"], check=False)
    assert proc.returncode == 1
    assert "error: model.data.train_ds.file_path is required" in proc.stderr, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
