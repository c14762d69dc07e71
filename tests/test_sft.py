"""SFT end to end: the script learns the built-in task, masks prompts, resumes exactly, and runs
with tensor and data parallelism with the same losses as one process."""

import json
import os
import re
import shutil

import pytest

from conftest import SCRIPTS, WORKERS, read_metrics, run_as_slurm_tasks, run_python, run_script, tiny_optim, train_losses, val_losses

SMALL = ["model.encoder_seq_length=32", "model.data.train_ds.micro_batch_size=4",
         "model.data.train_ds.global_batch_size=16"]


def sft_overrides(data, log_dir, steps, extra=()):
    return [
        f"model.data.train_ds.file_path={data['sft_train']}",
        f"model.data.validation_ds.file_path={data['sft_val']}",
        f"exp_manager.explicit_log_dir={log_dir}",
        f"trainer.sft.max_steps={steps}",
        "trainer.sft.max_epochs=1000",
        *tiny_optim(1e-3, 1e-4, 10),
        *extra,
    ]


@pytest.mark.learning
@pytest.mark.parametrize("seed", [1234, 7, 11])
def test_sft_lowers_validation_loss(tmp_path, builtin_data, seed):
    log_dir = tmp_path / "sft"
    proc = run_script("train_gpt_sft.py", sft_overrides(builtin_data, log_dir, 150, [
        "trainer.sft.val_check_interval=50", "model.optim.sched.warmup_steps=5", f"model.seed={seed}"]))
    val = val_losses(log_dir)
    assert sorted(val) == [50, 100, 150]
    # Random init starts near ln(262) = 5.6; the task is learnable, so the loss must fall far.
    assert val[150] < 0.6 * val[50] and val[150] < 1.0, val
    nemo = log_dir / "checkpoints" / "megatron_gpt_sft.nemo"
    assert nemo.is_file()
    assert f".nemo written to {nemo}" in proc.stdout
    assert "SFT finished: 150 steps" in proc.stdout


def test_tensorboard_wandb_and_metrics_are_logged(tmp_path, builtin_data):
    """TensorBoard events, an offline wandb run in the log directory and the train metrics."""
    log_dir = tmp_path / "sft"
    run_script("train_gpt_sft.py", sft_overrides(builtin_data, log_dir, 2, [
        "exp_manager.create_wandb_logger=True", "exp_manager.wandb_logger_kwargs.project=sft_test",
        "exp_manager.create_checkpoint_callback=False"]))
    assert any(name.startswith("events.out.tfevents") for name in os.listdir(log_dir))
    assert any(name.startswith("offline-run-") for name in os.listdir(log_dir / "wandb"))
    record = next(r for r in read_metrics(log_dir) if r.get("step") == 1 and "train/loss" in r)
    assert {"train/lr", "train/grad_norm", "train/tokens_per_sec"} <= set(record)


@pytest.mark.stack
@pytest.mark.parametrize("precision", ["32", "bf16"])
def test_resume_equals_uninterrupted_run(tmp_path, builtin_data, precision):
    """Stop after step 8 (of 12), resume from its checkpoint, compare every later step's loss.

    Dropout is on (RNG state must be restored) and the 96-sample file makes the run cross
    epoch boundaries (data order must be restored); the cosine schedule and Adam moments
    are mid-flight at step 8. With bf16 the optimizer's fp32 master weights must be restored too.
    """
    from nemo_aligner.data.nlp.jsonl import read_jsonl, write_jsonl

    small = tmp_path / "train96.jsonl"
    write_jsonl(str(small), [{k: v for k, v in r.items() if not k.startswith("__")}
                             for r in read_jsonl(builtin_data["sft_train"])[:96]])
    data = dict(builtin_data, sft_train=str(small))
    common = SMALL + [f"trainer.precision={precision}", "model.hidden_dropout=0.1", "model.attention_dropout=0.1",
                      "trainer.sft.save_interval=4", "trainer.sft.val_check_interval=4",
                      "model.optim.sched.warmup_steps=2", "exp_manager.checkpoint_callback_params.save_top_k=-1"]
    full = tmp_path / "full"
    run_script("train_gpt_sft.py", sft_overrides(data, full, 12, common))
    ckpts = sorted(os.listdir(full / "checkpoints"))
    step8 = [c for c in ckpts if "-step=8-" in c]
    assert step8, ckpts

    resumed = tmp_path / "resumed"
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(full / "checkpoints" / step8[0], resumed / "checkpoints" / step8[0])
    proc = run_script("train_gpt_sft.py", sft_overrides(data, resumed, 12, common))
    assert "resumed at step 8" in proc.stdout
    before, after = train_losses(full), train_losses(resumed)
    assert sorted(after) == [9, 10, 11, 12]
    for step in after:
        assert after[step] == pytest.approx(before[step], rel=1e-6, abs=1e-7), step
    assert val_losses(resumed)[12] == pytest.approx(val_losses(full)[12], rel=1e-6)
    # The data really crossed epochs (96 samples / 16 per step = 6 steps per epoch).
    assert json.loads((resumed / "checkpoints" / step8[0] / "trainer_state.json").read_text())["epoch"] == 1


@pytest.mark.stack
@pytest.mark.parametrize("parallel", [["model.tensor_model_parallel_size=2"], ["model.pipeline_model_parallel_size=2"], []],
                         ids=["tp2", "pp2", "dp2"])
def test_sft_script_two_processes_matches_one(tmp_path, builtin_data, base_nemo, parallel):
    nemo, _ = base_nemo
    extra = SMALL + [f"model.restore_from_path={nemo}", "trainer.sft.val_check_interval=3",
                     "model.optim.sched.warmup_steps=0"]
    one = tmp_path / "one"
    run_script("train_gpt_sft.py", sft_overrides(builtin_data, one, 3, extra))
    two = tmp_path / "two"
    run_script("train_gpt_sft.py", sft_overrides(builtin_data, two, 3, extra + ["trainer.devices=2", *parallel]),
               nproc=2)
    a, b = train_losses(one), train_losses(two)
    assert sorted(a) == sorted(b) == [1, 2, 3]
    for step in a:
        assert b[step] == pytest.approx(a[step], rel=2e-5), step
    assert val_losses(two)[3] == pytest.approx(val_losses(one)[3], rel=2e-5)


@pytest.mark.stack
def test_distributed_optimizer_resume_dp2(tmp_path, builtin_data, base_nemo):
    """megatron-core's DistributedOptimizer (state sharded over DP=2): resume is exact too, which
    needs dp_reshardable checkpoints and a per-parameter Adam step after loading. always_save_nemo
    with save_best_model decides on rank 0 and writes the .nemo on both ranks."""
    nemo, _ = base_nemo
    common = SMALL + [f"model.restore_from_path={nemo}", "model.optim.name=distributed_fused_adam",
                      "trainer.devices=2", "trainer.sft.save_interval=2", "trainer.sft.val_check_interval=2",
                      "model.optim.sched.warmup_steps=1", "exp_manager.checkpoint_callback_params.save_top_k=-1",
                      "exp_manager.checkpoint_callback_params.save_nemo_on_train_end=False",
                      "exp_manager.checkpoint_callback_params.always_save_nemo=True",
                      "exp_manager.checkpoint_callback_params.save_best_model=True"]
    full = tmp_path / "full"
    proc = run_script("train_gpt_sft.py", sft_overrides(builtin_data, full, 4, common), nproc=2)
    assert "always_save_nemo: " in proc.stdout + proc.stderr
    assert (full / "checkpoints" / "megatron_gpt_sft.nemo").is_file()
    step2 = [c for c in os.listdir(full / "checkpoints") if "-step=2-" in c]
    resumed = tmp_path / "resumed"
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(full / "checkpoints" / step2[0], resumed / "checkpoints" / step2[0])
    run_script("train_gpt_sft.py", sft_overrides(builtin_data, resumed, 4, common), nproc=2)
    before, after = train_losses(full), train_losses(resumed)
    assert sorted(after) == [3, 4]
    for step in after:
        assert after[step] == pytest.approx(before[step], rel=1e-6), step


def test_max_time_saves_and_stops(tmp_path, builtin_data):
    log_dir = tmp_path / "timed"
    proc = run_script("train_gpt_sft.py", sft_overrides(builtin_data, log_dir, 50, SMALL + [
        "trainer.sft.max_time=00:00:00:00", "trainer.sft.val_check_interval=10"]))
    assert "SFT finished: 1 steps" in proc.stdout
    ckpts = [c for c in os.listdir(log_dir / "checkpoints") if "-step=1-" in c]
    assert len(ckpts) == 1
    # Not finished, so no final .nemo yet; a rerun resumes from step 1.
    assert not (log_dir / "checkpoints" / "megatron_gpt_sft.nemo").exists()
    proc = run_script("train_gpt_sft.py", sft_overrides(builtin_data, log_dir, 3, SMALL + [
        "trainer.sft.val_check_interval=10"]))
    assert "resumed at step 1" in proc.stdout and "SFT finished: 3 steps" in proc.stdout


def test_sample_lets_max_steps_outlast_one_pass(tmp_path, builtin_data):
    """NeMo-Aligner's ``model.data.sample=True``: 20 records make one global batch of 16 a pass, yet
    ``max_steps=3`` with ``max_epochs=1`` trains 3 steps on 48 records drawn from the 20; validation
    takes ``limit_val_batches=5`` x its global batch of 8 records drawn from its 64."""
    train = tmp_path / "twenty.jsonl"
    with open(builtin_data["sft_train"]) as f:
        train.write_text("".join(f.readlines()[:20]))
    data = dict(builtin_data, sft_train=str(train))
    overrides = sft_overrides(data, tmp_path / "sampled", 3, SMALL + ["trainer.sft.val_check_interval=3"])
    overrides = [o for o in overrides if not o.startswith("trainer.sft.max_epochs=")] + ["trainer.sft.max_epochs=1"]
    proc = run_script("train_gpt_sft.py", overrides + [
        "model.data.sample=True", "trainer.sft.limit_val_batches=5", "model.data.validation_ds.global_batch_size=8",
        "model.data.validation_ds.micro_batch_size=4"])
    out = proc.stdout + proc.stderr
    assert "model.data.sample=True: 48 training records (trainer.sft.max_steps=3 x global_batch_size=16) " \
           "drawn from 20" in out
    assert "model.data.sample=True: 40 validation records (trainer.sft.limit_val_batches=5 x global_batch_size=8) " \
           "drawn from 64" in out
    assert "48 training samples, 40 validation samples" in out
    assert "SFT finished: 3 steps, 1 epochs" in proc.stdout


def test_sft_chat_format(tmp_path, builtin_data):
    log_dir = tmp_path / "chat"
    run_script("train_gpt_sft.py", [
        f"model.data.train_ds.file_path={builtin_data['chat_train']}",
        f"model.data.validation_ds.file_path={builtin_data['chat_val']}",
        f"exp_manager.explicit_log_dir={log_dir}", "model.data.chat=True",
        "trainer.sft.max_steps=40", "trainer.sft.max_epochs=100", "trainer.sft.val_check_interval=20",
        *tiny_optim(1e-3, 1e-4, 2), *SMALL, "model.encoder_seq_length=64"])
    val = val_losses(log_dir)
    assert 0.0 < val[40] < val[20] < 3.0, val
    assert next(r for r in read_metrics(log_dir) if "val/tokens" in r)["val/tokens"] > 64 * 4


def test_slurm_variables_start_data_parallel(tmp_path, builtin_data, base_nemo):
    """Two tasks started as srun starts them (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, the first
    host of SLURM_JOB_NODELIST, a port from SLURM_JOB_ID) train with DP=2 like torchrun does."""
    nemo, _ = base_nemo
    extra = SMALL + [f"model.restore_from_path={nemo}", "trainer.sft.val_check_interval=2",
                     "model.optim.sched.warmup_steps=0"]
    one = tmp_path / "one"
    run_script("train_gpt_sft.py", sft_overrides(builtin_data, one, 2, extra))
    slurm = tmp_path / "slurm"
    outputs = run_as_slurm_tasks(os.path.join(SCRIPTS, "train_gpt_sft.py"),
                                 sft_overrides(builtin_data, slurm, 2, extra + ["trainer.devices=2"]))
    assert "data parallel 2" in outputs[0][0]
    a, b = train_losses(one), train_losses(slurm)
    for step in (1, 2):
        assert b[step] == pytest.approx(a[step], rel=2e-5), step


@pytest.mark.stack
@pytest.mark.parametrize("precision", ["32", "bf16"])
def test_resumes_a_training_checkpoint_nemo_wrote(tmp_path, builtin_data, base_nemo, precision):
    """A log directory holding NeMo(-Aligner)'s checkpoints (Transformer Engine names, Lightning's
    common.pt with the config as OmegaConf objects, the state in the directory name) resumes from the
    newest finished one, as NeMo-Aligner does: the step after it trains on the same batch with the same
    weights and learning rate as an uninterrupted run (same loss); the schedule goes on; a save NeMo
    marked unfinished is skipped. With bf16 the float32 master weights start from the loaded weights."""
    nemo, _ = base_nemo
    common = SMALL + [f"model.restore_from_path={nemo}", f"trainer.precision={precision}",
                      "trainer.sft.save_interval=4", "trainer.sft.val_check_interval=4",
                      "model.optim.sched.warmup_steps=2", "exp_manager.checkpoint_callback_params.save_top_k=-1"]
    full = tmp_path / "full"
    run_script("train_gpt_sft.py", sft_overrides(builtin_data, full, 8, common))
    step4 = next(c for c in os.listdir(full / "checkpoints") if "-step=4-" in c)
    resumed = tmp_path / "resumed"
    name = "megatron_gpt_sft--validation_loss={}-step={}-consumed_samples={}.0-epoch=0"
    for step, lr_steps in ((4, 4), (2, 2)):
        run_python(os.path.join(WORKERS, "nemo_training_checkpoint.py"), [
            "--nemo", str(nemo), "--weights", str(full / "checkpoints" / step4), "--te",
            "--scheduler-steps", str(lr_steps), "--out",
            str(resumed / "checkpoints" / (name.format("2.345", step, 16 * step) + ("-last" if step == 4 else "")))])
    # a newer save that never finished: NeMo's marker beside it
    unfinished = resumed / "checkpoints" / (name.format("2.100", 6, 96) + "-last")
    shutil.copytree(resumed / "checkpoints" / (name.format("2.345", 4, 64) + "-last"), unfinished)
    (resumed / "checkpoints" / (unfinished.name + "-unfinished")).write_text("")
    proc = run_script("train_gpt_sft.py", sft_overrides(builtin_data, resumed, 8, common))
    out = proc.stdout + proc.stderr
    assert "resumed at step 4 (64 samples consumed)" in out, out[-3000:]
    assert "a checkpoint NeMo wrote" in out and "optimizer state (Adam moments" in out
    assert f"skipped {unfinished} when choosing the checkpoint to resume" in out
    before, after = train_losses(full), train_losses(resumed)
    assert sorted(after) == [5, 6, 7, 8]
    assert after[5] == pytest.approx(before[5], rel=1e-6, abs=1e-7)
    lrs = {r["step"]: r["train/lr"] for r in read_metrics(full) if "train/lr" in r}
    for step, lr in ((r["step"], r["train/lr"]) for r in read_metrics(resumed) if "train/lr" in r):
        assert lr == pytest.approx(lrs[step], rel=1e-9), step
    # training goes on from the loaded weights (fresh Adam moments: near, not equal, the full run's losses)
    for step in (6, 7, 8):
        assert after[step] == pytest.approx(before[step], rel=0.1), (step, after, before)
    assert after[8] < after[5]


def test_resume_with_a_changed_config_says_what_it_keeps(tmp_path, builtin_data):
    """Resuming with a config that differs from the checkpoint's run: the learning-rate schedule
    continues from the checkpoint with a warning naming the differences, or follows the config with
    override_checkpoint_schedule; other training data is a warning (the rest of the epoch is drawn
    anew); a checkpoint of another algorithm is refused."""
    from nemo_aligner.data.nlp.jsonl import read_jsonl, write_jsonl
    from nemo_aligner.utils.errors import CheckpointError
    from nemo_aligner.utils.train_checkpoint import check_resumed_run

    records = [{k: v for k, v in r.items() if not k.startswith("__")} for r in read_jsonl(builtin_data["sft_train"])]
    for n in (96, 80):
        write_jsonl(str(tmp_path / f"train{n}.jsonl"), records[:n])
    data = dict(builtin_data, sft_train=str(tmp_path / "train96.jsonl"))
    common = SMALL + ["trainer.sft.save_interval=4", "trainer.sft.val_check_interval=4",
                      "model.optim.sched.warmup_steps=2", "exp_manager.checkpoint_callback_params.save_top_k=-1"]
    full = tmp_path / "full"
    run_script("train_gpt_sft.py", sft_overrides(data, full, 6, common))
    step4 = next(c for c in os.listdir(full / "checkpoints") if "-step=4-" in c)
    lrs = {r["step"]: r["train/lr"] for r in read_metrics(full) if "train/lr" in r}

    def resume(name, run_data, extra=()):
        log_dir = tmp_path / name
        (log_dir / "checkpoints").mkdir(parents=True)
        shutil.copytree(full / "checkpoints" / step4, log_dir / "checkpoints" / step4)
        proc = run_script("train_gpt_sft.py", sft_overrides(run_data, log_dir, 6, common + list(extra)))
        return proc.stdout + proc.stderr, {r["step"]: r["train/lr"] for r in read_metrics(log_dir) if "train/lr" in r}

    out, kept = resume("new_lr", data, ["model.optim.lr=5e-4"])
    assert "its learning-rate schedule continues" in out and "override_checkpoint_schedule=True" in out, out[-3000:]
    assert kept[5] == pytest.approx(lrs[5], rel=1e-9)
    out, overridden = resume("override", data, ["model.optim.lr=5e-4", "++model.optim.sched.override_checkpoint_schedule=True"])
    assert "its learning-rate schedule continues" not in out
    assert overridden[5] != pytest.approx(lrs[5], rel=1e-3) and overridden[5] < 5e-4
    out, _ = resume("less_data", dict(data, sft_train=str(tmp_path / "train80.jsonl")))
    assert "training samples 96 -> 80" in out and "may repeat and others be skipped" in out, out[-3000:]
    ckpt = str(full / "checkpoints" / step4)
    saved = json.loads((full / "checkpoints" / step4 / "trainer_state.json").read_text())
    assert saved["algorithm"] == "sft" and saved["train_samples"] == 96
    with pytest.raises(CheckpointError, match=r"was saved by a 'sft' run; this is 'dpo' \(trainer\.dpo\)"):
        check_resumed_run(ckpt, saved, dict(saved, algorithm="dpo"), "trainer.dpo")


def checkpoint_weight(directory, key="model.output_layer.weight"):
    """One tensor of a distributed checkpoint, through torch DCP's reader (format_utils.dcp_to_torch_save
    fails on torch 2.6)."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    reader = dcp.FileSystemReader(str(directory))
    state = {key: torch.empty(reader.read_metadata().state_dict_metadata[key].size)}
    dcp.load(state, storage_reader=reader, planner=DefaultLoadPlanner(flatten_state_dict=False))
    return state[key]


def test_save_best_model_writes_the_best_checkpoints_weights(tmp_path, builtin_data):
    """NeMo's checkpoint_callback_params.save_best_model: the final .nemo holds the best checkpoint's
    weights. mode=max on the validation loss makes the first checkpoint (step 3, before the loss
    falls) the best, so the .nemo must equal it and differ from the last (step 6)."""
    import torch

    from nemo_aligner.utils import nemo_file

    log_dir = tmp_path / "sft"
    proc = run_script("train_gpt_sft.py", sft_overrides(builtin_data, log_dir, 6, SMALL + [
        "trainer.sft.val_check_interval=3", "model.optim.lr=1e-3", "model.optim.sched.warmup_steps=0",
        "exp_manager.checkpoint_callback_params.mode=max", "exp_manager.checkpoint_callback_params.save_top_k=-1",
        "exp_manager.checkpoint_callback_params.save_best_model=True"]))
    val = val_losses(log_dir)
    assert val[3] > val[6], val  # step 3 is the best by mode=max
    checkpoints = {int(name.split("step=")[1].split("-")[0]): log_dir / "checkpoints" / name
                   for name in os.listdir(log_dir / "checkpoints") if "step=" in name and not name.endswith(".nemo")}
    assert sorted(checkpoints) == [3, 6]

    with nemo_file.extracted(str(log_dir / "checkpoints" / "megatron_gpt_sft.nemo")) as directory:
        final = checkpoint_weight(nemo_file.weights_dir(directory))
    assert torch.equal(final, checkpoint_weight(checkpoints[3]))
    assert not torch.equal(final, checkpoint_weight(checkpoints[6]))
    assert "best checkpoint" in proc.stderr + proc.stdout


def test_always_save_nemo_writes_a_nemo_with_each_checkpoint(tmp_path, builtin_data):
    """NeMo's checkpoint_callback_params.always_save_nemo: the .nemo is rewritten with every checkpoint;
    with save_best_model only when a checkpoint is the new best (mode=max on the validation loss: the
    first one, step 2). save_nemo_on_train_end (on) does not write it again: it already holds the
    weights the end of training would write (the step-6 checkpoint's, or the best's)."""
    import torch

    from nemo_aligner.utils import nemo_file

    def run(name, extra):
        log_dir = tmp_path / name
        proc = run_script("train_gpt_sft.py", sft_overrides(builtin_data, log_dir, 6, SMALL + [
            "trainer.sft.val_check_interval=2", "model.optim.lr=1e-3", "model.optim.sched.warmup_steps=0",
            "exp_manager.checkpoint_callback_params.save_top_k=-1",
            "exp_manager.checkpoint_callback_params.always_save_nemo=True"] + extra))
        checkpoints = {int(n.split("step=")[1].split("-")[0]): log_dir / "checkpoints" / n
                       for n in os.listdir(log_dir / "checkpoints") if "step=" in n and not n.endswith(".nemo")}
        assert sorted(checkpoints) == [2, 4, 6]
        with nemo_file.extracted(str(log_dir / "checkpoints" / "megatron_gpt_sft.nemo")) as directory:
            saved = checkpoint_weight(nemo_file.weights_dir(directory))
        lines = (proc.stderr + proc.stdout).splitlines()
        written = [line for line in lines if "always_save_nemo: " in line]
        kept = [line for line in lines if "save_nemo_on_train_end: " in line and "already holds" in line]
        assert len(kept) == 1, lines  # the end of training wrote nothing
        return saved, {step: checkpoint_weight(path) for step, path in checkpoints.items()}, written, val_losses(log_dir)

    saved, weights, written, _ = run("every", [])
    assert torch.equal(saved, weights[6]) and not torch.equal(saved, weights[4])
    assert [re.search(r"-step=(\d+)-", line).group(1) for line in written] == ["2", "4", "6"], written
    saved, weights, written, val = run("best", ["exp_manager.checkpoint_callback_params.mode=max",
                                                 "exp_manager.checkpoint_callback_params.save_best_model=True"])
    assert val[2] > max(val[4], val[6]), val  # step 2 is the best by mode=max
    assert torch.equal(saved, weights[2]) and not torch.equal(saved, weights[6])
    assert len(written) == 1 and "-step=2-" in written[0], written


def test_checkpoints_between_validations_carry_no_stale_score_and_lr_is_the_one_used(tmp_path, builtin_data):
    """A save at a step that did not validate (step 3 here, validation every 2) is not scored with an
    earlier validation: pruning and save_best_model must not prefer it over the checkpoint that
    earned that score. The logged learning rate is the one the step used (NeMo's warm-up: step k
    of a 4-step warm-up uses lr * k / 5)."""
    from nemo_aligner.utils.checkpoint_callback import list_checkpoints

    log_dir = tmp_path / "sft"
    run_script("train_gpt_sft.py", sft_overrides(builtin_data, log_dir, 4, SMALL + [
        "trainer.sft.val_check_interval=2", "trainer.sft.save_interval=3", "model.optim.lr=1e-3",
        "model.optim.sched.name=Constant", "model.optim.sched.warmup_steps=4",
        "exp_manager.checkpoint_callback_params.save_top_k=-1"]))
    states = {state["step"]: state for _, state in list_checkpoints(str(log_dir / "checkpoints"))}
    assert sorted(states) == [3, 4]
    assert states[3]["monitor_value"] is None  # validated at step 2, saved at 3: no score
    assert states[4]["monitor_value"] == pytest.approx(val_losses(log_dir)[4])
    lrs = {r["step"]: r["train/lr"] for r in read_metrics(log_dir) if "train/lr" in r}
    assert [lrs[k] for k in (1, 2, 3, 4)] == pytest.approx([1e-3 * k / 5 for k in (1, 2, 3, 4)], rel=1e-6)


def test_a_fresh_run_sets_an_earlier_runs_checkpoints_aside(tmp_path, builtin_data):
    """Without resume_if_exists, a run into a directory holding an earlier run's checkpoints moves them
    aside (whole) instead of pruning, ranking or resuming across the two runs."""
    log_dir = tmp_path / "sft"
    first = sft_overrides(builtin_data, log_dir, 2, SMALL + ["trainer.sft.val_check_interval=2"])
    run_script("train_gpt_sft.py", first)
    before = sorted(os.listdir(log_dir / "checkpoints"))
    proc = run_script("train_gpt_sft.py", sft_overrides(builtin_data, log_dir, 1, SMALL + [
        "trainer.sft.val_check_interval=1", "exp_manager.resume_if_exists=False"]))
    aside = [name for name in os.listdir(log_dir) if name.startswith("checkpoints.before-")]
    assert len(aside) == 1 and sorted(os.listdir(log_dir / aside[0])) == before
    now = [name for name in os.listdir(log_dir / "checkpoints") if "step=" in name]
    assert len(now) == 1 and "step=1" in now[0]
    assert "were moved to" in proc.stderr + proc.stdout


@pytest.mark.learning
def test_sft_trains_a_mixture_of_experts_model(tmp_path, builtin_data):
    """NeMo's MoE keys on the command line build a routed model (4 experts, 2 per token, with the
    load-balancing loss) that learns the task, and its .nemo carries them."""
    log_dir = tmp_path / "sft"
    run_script("train_gpt_sft.py", sft_overrides(builtin_data, log_dir, 100, [
        "trainer.sft.val_check_interval=50", "model.optim.sched.warmup_steps=5", "++model.num_moe_experts=4",
        "++model.moe_router_topk=2", "++model.moe_aux_loss_coeff=0.01"]))
    val = val_losses(log_dir)
    assert val[100] < 0.75 * val[50] and val[100] < 1.2, val
    import tarfile

    import yaml
    with tarfile.open(log_dir / "checkpoints" / "megatron_gpt_sft.nemo") as tar:
        cfg = yaml.safe_load(tar.extractfile("./model_config.yaml").read())
    assert (cfg["num_moe_experts"], cfg["moe_router_topk"], cfg["moe_aux_loss_coeff"]) == (4, 2, 0.01)
    # DPO from it: the routed model restores, trains and saves again
    proc = run_script("train_gpt_dpo.py", [
        f"pretrained_checkpoint.restore_from_path={log_dir / 'checkpoints' / 'megatron_gpt_sft.nemo'}",
        f"model.data.data_prefix={{train: [{builtin_data['dpo_train']}], validation: [{builtin_data['dpo_val']}], "
        f"test: [{builtin_data['dpo_val']}]}}", f"exp_manager.explicit_log_dir={tmp_path / 'dpo'}",
        "trainer.dpo.max_steps=2", "trainer.dpo.max_epochs=10"])
    assert "DPO (dpo) finished: 2 steps" in proc.stdout


def test_sft_splits_experts_over_data_parallel_ranks(tmp_path, builtin_data):
    """model.expert_model_parallel_size=2 on two processes: training, validation and the .nemo all run with
    each rank holding half the experts (the numbers against one process: test_nemo_formats.py)."""
    log_dir = tmp_path / "sft"
    proc = run_script("train_gpt_sft.py", sft_overrides(builtin_data, log_dir, 4, [
        "trainer.devices=2", "trainer.sft.val_check_interval=2", "++model.num_moe_experts=4",
        "++model.moe_router_topk=2", "++model.expert_model_parallel_size=2"]), nproc=2)
    assert "(experts split over 2 of them)" in proc.stdout + proc.stderr
    assert sorted(val_losses(log_dir)) == [2, 4]
    nemo = log_dir / "checkpoints" / "megatron_gpt_sft.nemo"
    assert nemo.is_file()
    # DPO's pairs are padded per rank: the ranks' MoE layers see different token counts
    proc = run_script("train_gpt_dpo.py", [
        f"pretrained_checkpoint.restore_from_path={nemo}", "trainer.devices=2", "++model.expert_model_parallel_size=2",
        f"model.data.data_prefix={{train: [{builtin_data['dpo_train']}], validation: [{builtin_data['dpo_val']}], "
        f"test: [{builtin_data['dpo_val']}]}}", f"exp_manager.explicit_log_dir={tmp_path / 'dpo'}",
        "trainer.dpo.max_steps=2", "trainer.dpo.max_epochs=10"], nproc=2)
    assert "DPO (dpo) finished: 2 steps" in proc.stdout
