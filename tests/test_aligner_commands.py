"""NeMo-Aligner's functional CI commands (tests/functional/{sft,rm,dpo}.sh) run here with only paths
and sizes changed, launched as NeMo-Aligner launches them (torchrun, 2 processes, Hydra's flags
first), on the built-in data and a tiny model."""

import os

from conftest import SCRIPTS, read_metrics, run_python, train_losses

CONF = os.path.join(SCRIPTS, "conf")


def _run(script, args):
    return run_python(os.path.join(SCRIPTS, script), args, nproc=2, timeout=600)


def test_sft_sh(tmp_path, task_data, sft_nemo):
    log_dir = tmp_path / "sft"
    proc = _run("train_gpt_sft.py", [
        f"--config-path={CONF}", "--config-name=gpt_sft",
        "trainer.num_nodes=1", "trainer.devices=2", "++model.mcore_gpt=True", "++model.megatron_amp_O2=True",
        f"model.restore_from_path={sft_nemo}", "exp_manager.create_checkpoint_callback=False",
        "model.data.num_workers=0", "model.data.chat=True",
        "model.data.chat_prompt_tokens.system_turn_start='<extra_id_0>'",
        "model.data.chat_prompt_tokens.turn_start='<extra_id_1>'",
        "model.data.chat_prompt_tokens.label_start='<extra_id_2>'",
        "model.data.train_ds.max_seq_length=64", "model.data.train_ds.micro_batch_size=1",
        "model.data.train_ds.global_batch_size=4", f"model.data.train_ds.file_path={task_data['chat_train']}",
        f"model.data.train_ds.index_mapping_dir={tmp_path}", "model.data.train_ds.add_eos=False",
        "model.data.train_ds.hf_dataset=True", "model.data.validation_ds.max_seq_length=64",
        f"model.data.validation_ds.file_path={task_data['chat_val']}", "model.data.validation_ds.micro_batch_size=1",
        "model.data.validation_ds.global_batch_size=4", f"model.data.validation_ds.index_mapping_dir={tmp_path}",
        "model.data.validation_ds.add_eos=False", "model.data.validation_ds.hf_dataset=True",
        "model.answer_only_loss=True", "++model.tensor_model_parallel_size=1", "++model.pipeline_model_parallel_size=1",
        "trainer.sft.max_steps=5", "trainer.sft.val_check_interval=1", "trainer.sft.limit_val_batches=8",
        "trainer.sft.save_interval=0", f"exp_manager.explicit_log_dir={log_dir}",
        "++model.activations_checkpoint_granularity=full", "++model.activations_checkpoint_method=uniform",
        "++model.activations_checkpoint_num_layers=1", "++model.dist_ckpt_load_strictness=log_all"])
    assert sorted(train_losses(str(log_dir))) == [1, 2, 3, 4, 5]
    out = proc.stdout + proc.stderr
    assert "model.dist_ckpt_load_strictness is accepted for NeMo-Aligner's commands but changes nothing" in out
    assert "data parallel 2" in out


def test_rm_sh(tmp_path, task_data, sft_nemo):
    log_dir = tmp_path / "rm"
    data = task_data["regression_train"], task_data["regression_val"]
    proc = _run("train_reward_model.py", [
        f"--config-path={CONF}", "--config-name=training_rm",
        "trainer.num_nodes=1", "trainer.devices=2", "model.global_batch_size=4", "++model.data.data_impl=jsonl",
        "++model.data.train_ds.shuffle=False", "++model.data.validation_ds.shuffle=False",
        "++model.data.shuffle_documents=False",
        f"model.data.data_prefix={{train: [{data[0]}], validation: [{data[1]}], test: [{data[1]}]}}",
        "trainer.rm.val_check_interval=1", "exp_manager.create_wandb_logger=False",
        "exp_manager.wandb_logger_kwargs.name=rm_test", "exp_manager.wandb_logger_kwargs.project=rm_test",
        f"exp_manager.explicit_log_dir={log_dir}", "exp_manager.checkpoint_callback_params.save_top_k=2",
        "exp_manager.checkpoint_callback_params.save_nemo_on_train_end=False",
        f"pretrained_checkpoint.restore_from_path={sft_nemo}", "trainer.rm.save_interval=1",
        "trainer.rm.max_steps=1", "trainer.rm.limit_val_batches=2", "model.optim.lr=9e-7",
        "model.optim.sched.min_lr=9e-7", "model.optim.sched.constant_steps=0", "model.optim.sched.warmup_steps=10",
        "++model.tensor_model_parallel_size=1", "++model.pipeline_model_parallel_size=1",
        "++model.activations_checkpoint_granularity=full", "++model.activations_checkpoint_method=uniform",
        "++model.activations_checkpoint_num_layers=1", "++model.sequence_parallel=False",
        "model.reward_model_type=regression", "++model.dist_ckpt_load_strictness=log_all",
        "model.regression.num_attributes=9"])
    metrics = read_metrics(str(log_dir))
    assert any("train/loss" in r and r["step"] == 1 for r in metrics)
    assert os.listdir(log_dir / "checkpoints")  # save_interval=1: a checkpoint, and no .nemo at the end
    assert not any(name.endswith(".nemo") for name in os.listdir(log_dir / "checkpoints"))
    out = proc.stdout + proc.stderr
    for key in ("model.data.train_ds", "model.data.validation_ds", "model.data.shuffle_documents"):
        assert f"{key} is not read by nemo-aligner" in out


def test_dpo_sh(tmp_path, task_data, sft_nemo):
    log_dir = tmp_path / "dpo"
    data = task_data["dpo_train"], task_data["dpo_val"]
    proc = _run("train_gpt_dpo.py", [
        f"--config-path={CONF}", "--config-name=gpt_dpo", "trainer.num_nodes=1", "trainer.devices=2",
        "++model.data.seq_length=64", "++model.global_batch_size=4", "++model.micro_batch_size=1",
        "++model.mcore_gpt=true", "++model.megatron_amp_O2=true", "++model.dpo.ref_policy_kl_penalty=0.1",
        "++model.dpo.log_prob_forward_micro_batch_size=1", "++model.dpo.average_log_probs=false",
        "++model.dpo.sft_loss_weight=0.1", "++model.dpo.preference_loss_weight=1.0",
        f"pretrained_checkpoint.restore_from_path={sft_nemo}",
        f"model.data.data_prefix={{train: [{data[0]}], validation: [{data[1]}], test: [{data[1]}]}}",
        "exp_manager.create_checkpoint_callback=False", "model.data.num_workers=2",
        "++model.tensor_model_parallel_size=1", "++model.pipeline_model_parallel_size=1", "trainer.dpo.max_steps=3",
        "trainer.dpo.val_check_interval=3", "trainer.dpo.limit_val_batches=8", "trainer.dpo.save_interval=0",
        f"exp_manager.explicit_log_dir={log_dir}", "++model.activations_checkpoint_granularity=full",
        "++model.activations_checkpoint_method=uniform", "++model.activations_checkpoint_num_layers=1",
        "++model.dist_ckpt_load_strictness=log_all"])
    assert sorted(train_losses(str(log_dir))) == [1, 2, 3]
    # a stale key NeMo-Aligner itself no longer reads is named, not silently dropped
    assert "model.dpo.average_log_probs is not read by nemo-aligner" in proc.stdout + proc.stderr
