"""NeMo-Aligner's functional CI commands (tests/functional/{sft,rm,dpo,ppo,reinforce}.sh) run here with
only paths, ports and sizes changed, launched as NeMo-Aligner launches them (torchrun or mpirun, 2
processes, Hydra's flags first), on the built-in data and tiny models. PPO and REINFORCE run the
scripts' own `actor_nemo` variant (`trainer.*.trt_llm.enable=False`): TensorRT-LLM is not used here."""

import os
import shutil
import subprocess
import sys

from conftest import SCRIPTS, ServerProcess, free_port, read_metrics, run_python, subprocess_env, train_losses

CONF = os.path.join(SCRIPTS, "conf")


def _run(script, args):
    return run_python(os.path.join(SCRIPTS, script), args, nproc=2, timeout=600)


def test_sft_sh(tmp_path, task_data, quick_sft):
    log_dir = tmp_path / "sft"
    proc = _run("train_gpt_sft.py", [
        f"--config-path={CONF}", "--config-name=gpt_sft",
        "trainer.num_nodes=1", "trainer.devices=2", "++model.mcore_gpt=True", "++model.megatron_amp_O2=True",
        f"model.restore_from_path={quick_sft}", "exp_manager.create_checkpoint_callback=False",
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


def test_rm_sh(tmp_path, task_data, quick_sft):
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
        f"pretrained_checkpoint.restore_from_path={quick_sft}", "trainer.rm.save_interval=1",
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


def test_dpo_sh(tmp_path, task_data, quick_sft):
    log_dir = tmp_path / "dpo"
    data = task_data["dpo_train"], task_data["dpo_val"]
    proc = _run("train_gpt_dpo.py", [
        f"--config-path={CONF}", "--config-name=gpt_dpo", "trainer.num_nodes=1", "trainer.devices=2",
        "++model.data.seq_length=64", "++model.global_batch_size=4", "++model.micro_batch_size=1",
        "++model.mcore_gpt=true", "++model.megatron_amp_O2=true", "++model.dpo.ref_policy_kl_penalty=0.1",
        "++model.dpo.log_prob_forward_micro_batch_size=1", "++model.dpo.average_log_probs=false",
        "++model.dpo.sft_loss_weight=0.1", "++model.dpo.preference_loss_weight=1.0",
        f"pretrained_checkpoint.restore_from_path={quick_sft}",
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


def test_kto_in_dpo_sh_form(tmp_path, task_data, quick_sft):
    """NeMo-Aligner ships no kto.sh: its KTO docs' command in dpo.sh's form, with gpt_kto's keys."""
    log_dir = tmp_path / "kto"
    data = task_data["kto_train"], task_data["kto_val"]
    proc = _run("train_gpt_kto.py", [
        f"--config-path={CONF}", "--config-name=gpt_kto", "trainer.num_nodes=1", "trainer.devices=2",
        "++model.data.seq_length=64", "++model.global_batch_size=4", "++model.micro_batch_size=1",
        "++model.mcore_gpt=true", "++model.megatron_amp_O2=true", "++model.kto.ref_policy_kl_penalty=0.1",
        "++model.kto.preference_average_log_probs=false", "model.kto.sft_loss_weight=0",
        "model.kto.preference_loss_weight=1", f"pretrained_checkpoint.restore_from_path={quick_sft}",
        f"model.data.data_prefix={{train: [{data[0]}], validation: [{data[1]}], test: [{data[1]}]}}",
        "exp_manager.create_checkpoint_callback=False", "model.data.num_workers=2",
        "++model.tensor_model_parallel_size=1", "++model.pipeline_model_parallel_size=1", "trainer.kto.max_steps=3",
        "trainer.kto.val_check_interval=3", "trainer.kto.limit_val_batches=8", "trainer.kto.save_interval=0",
        f"exp_manager.explicit_log_dir={log_dir}", "++model.dist_ckpt_load_strictness=log_all"])
    assert sorted(train_losses(str(log_dir))) == [1, 2, 3]
    assert "Traceback" not in proc.stderr


def _actor(script, args, tmp_path):
    """The actor as NeMo-Aligner starts it: ``mpirun -np 2 python -u ...`` (torchrun without Open MPI)."""
    path = os.path.join(SCRIPTS, script)
    if shutil.which("mpirun"):
        cmd = ["mpirun", "-np", "2", "--oversubscribe", sys.executable, "-u", path, *args]
        if os.geteuid() == 0:
            cmd.insert(1, "--allow-run-as-root")
        proc = subprocess.run(cmd, env=subprocess_env(2), capture_output=True, text=True, timeout=600, cwd=tmp_path)
        assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-6000:]
        return proc
    return run_python(path, args, nproc=2, timeout=600, cwd=tmp_path)


def _actor_args(alg, data, actor_nemo, log_dir):
    """The actor overrides shared by ppo.sh and reinforce.sh (GBS=2, TP=1, PP=2, actor_nemo)."""
    return [
        f"++model.data.data_prefix={{train: [{data['prompts_train']}], validation: [{data['prompts_val']}], "
        f"test: [{data['prompts_val']}]}}",
        f"pretrained_checkpoint.restore_from_path={actor_nemo}", f"exp_manager.explicit_log_dir={log_dir}",
        "exp_manager.create_wandb_logger=True", f"exp_manager.wandb_logger_kwargs.name={alg}_actor",
        f"exp_manager.wandb_logger_kwargs.project={alg}_test", "exp_manager.create_checkpoint_callback=True",
        "trainer.num_nodes=1", "trainer.devices=2", f"trainer.{alg}.trt_llm.enable=True",
        "++model.offload_adam_states=False", f"trainer.{alg}.trt_llm.reshard=True", f"trainer.{alg}.val_check_interval=2",
        f"++trainer.{alg}.save_interval=2", "++model.micro_batch_size=1", "++model.global_batch_size=2",
        "++model.tensor_model_parallel_size=1", "++model.pipeline_model_parallel_size=2",
        f"++model.{alg}.entropy_bonus=0.0", f"++model.{alg}.ratio_eps=0.2", "++model.encoder_seq_length=64",
        "++exp_manager.checkpoint_callback_params.save_top_k=10", f"++model.{alg}.num_rollout_samples=2",
        f"++model.{alg}.rollout_micro_batch_size=1", f"++model.{alg}.length_params.max_length=32",
        f"++model.{alg}.forward_micro_batch_size=1", f"trainer.{alg}.initial_policy_kl_penalty=0.03",
        f"trainer.{alg}.rollout_batch_seq_length=32", f"++trainer.{alg}.flask_server.enable=True",
        "++model.optim.lr=9e-7", "++model.optim.sched.min_lr=8.9e-7",
        "++model.activations_checkpoint_granularity=full", "++model.activations_checkpoint_method=uniform",
        "++model.activations_checkpoint_num_layers=1", "++model.optim.bucket_cap_mb=200",
        "++model.optim.overlap_grad_sync=False", "++model.optim.contiguous_grad_buffer=True", "++model.enable_nge=True",
    ]


def _actor_tail(alg):
    return ["+model.overwrite_base_config.optim=True", "~model.optim", "++model.optim={name:sgd}",
            f"model.{alg}.sampling_params.use_greedy=True", f"trainer.{alg}.save_interval=0",
            f"trainer.{alg}.max_steps=3", f"trainer.{alg}.trt_llm.model_type=llama", "++exp_manager=null"]


def test_ppo_sh_actor_nemo(tmp_path, task_data, quick_sft, quick_rm):
    rm_nemo = quick_rm
    port = free_port()
    critic = ServerProcess(tmp_path, "serve_ppo_critic.py", "critic server ready").start([
        f"--config-path={CONF}", "--config-name=gpt_ppo_critic", "trainer.devices=1", "trainer.num_nodes=1",
        f"exp_manager.explicit_log_dir={tmp_path / 'critic'}", "exp_manager.create_wandb_logger=True",
        "exp_manager.wandb_logger_kwargs.name=ppo_critic", "exp_manager.wandb_logger_kwargs.project=ppo_test",
        "trainer.ppo.inference_micro_batch_size=1", "++model.tensor_model_parallel_size=1",
        "++model.pipeline_model_parallel_size=1", f"trainer.ppo.port={port}", f"++trainer.ppo.grpc_port={free_port()}",
        f"++trainer.ppo.metrics_port={free_port()}", "++model.reward_model_type=regression",
        "++model.regression.num_attributes=1", "++model.forward_mbs=1", "++model.micro_batch_size=1",
        "++model.global_batch_size=1", "++model.tensor_model_parallel_size=1", "++model.optim.bucket_cap_mb=200",
        "++model.optim.overlap_grad_sync=False", "++model.optim.contiguous_grad_buffer=True",
        "++trainer.ppo.pad_sequence_length_to_multiple=32", "model.reward_standardization.enable=True",
        "model.reward_standardization.mean=5.3735", "model.reward_standardization.std=1.2723",
        f"pretrained_checkpoint.restore_from_path={rm_nemo}", "++model.mcore_gpt=True",
        "exp_manager.create_checkpoint_callback=False", "exp_manager.create_wandb_logger=False",
        "model.encoder_seq_length=1536"])
    with critic:
        proc = _actor("train_gpt_ppo_actor.py", [
            f"--config-path={CONF}", "--config-name=gpt_ppo_actor", *_actor_args("ppo", task_data, quick_sft,
                                                                                 tmp_path / "actor"),
            "remote_critic_rm.critic.ip=localhost", f"remote_critic_rm.critic.port={port}", *_actor_tail("ppo"),
            "remote_critic_rm.pad_to_length=768", "trainer.ppo.trt_llm.enable=False"], tmp_path)
    out = proc.stdout + proc.stderr
    assert "PPO finished: 3 steps" in out, out[-3000:]
    assert "pipeline parallel 2" in out
    assert "model.enable_nge is not read by nemo-aligner" in out


def test_reinforce_sh_actor_nemo(tmp_path, task_data, quick_sft, quick_rm):
    rm_nemo = quick_rm
    port = free_port()
    server = ServerProcess(tmp_path, "serve_reward_model.py", "reward model server ready").start([
        "trainer.devices=1", "trainer.num_nodes=1", f"inference.port={port}", f"inference.grpc_port={free_port()}",
        f"inference.metrics_port={free_port()}", "++model.tensor_model_parallel_size=1",
        "++model.pipeline_model_parallel_size=1", "++model.dist_ckpt_load_strictness=log_all",
        f"rm_model_file={rm_nemo}"])
    with server:
        proc = _actor("train_gpt_reinforce_actor.py", [
            *_actor_args("reinforce", task_data, quick_sft, tmp_path / "actor"),
            "remote_rm.reward_model.ip=localhost", f"remote_rm.reward_model.port={port}", *_actor_tail("reinforce"),
            "++model.dist_ckpt_load_strictness=log_all", "trainer.reinforce.trt_llm.enable=False"], tmp_path)
    out = proc.stdout + proc.stderr
    assert "REINFORCE finished: 3 steps" in out or "finished: 3 steps" in out, out[-3000:]
    assert "exp_manager is null" in out
    assert not os.path.exists(tmp_path / "actor")  # exp_manager=null: NeMo writes no checkpoints there
