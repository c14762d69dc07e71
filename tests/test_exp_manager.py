"""The experiment manager refuses, in one line and before writing anything, a log directory in use
by a live run, a log directory that is a file, checkpoint settings it would misread and a logger
whose package is missing; a run that fails while starting leaves the previous run's hparams.yaml as
it was."""

import subprocess
import sys

import pytest
from omegaconf import OmegaConf

from nemo_aligner.utils.errors import ConfigError
from nemo_aligner.utils.exp_manager import exp_manager


def manage(log_dir, **params):
    exp = OmegaConf.create({"explicit_log_dir": str(log_dir), "create_tensorboard_logger": False,
                            "checkpoint_callback_params": params})
    return exp_manager(exp, OmegaConf.create({"model": {"lr": 1}}))


def test_a_log_dir_in_use_by_a_live_run_is_refused(tmp_path):
    log_dir = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", f"""
import time
from nemo_aligner.utils.exp_manager import lock_log_dir
import os
os.makedirs({str(log_dir)!r}, exist_ok=True)
lock_log_dir({str(log_dir)!r})
print("locked", flush=True)
time.sleep(60)
"""], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(ConfigError, match=rf"run is in use by a running job \(pid {holder.pid} on "):
            manage(log_dir)
    finally:
        holder.kill()
        holder.wait()
    manage(log_dir)  # the job has ended: its lock went with it
    manage(log_dir)  # this process holds it already


CHECKPOINT_SETTING_CASES = {
    "filename-tmp": ({"filename": "model-{step}.tmp"}, r"filename='model-\{step\}\.tmp': a checkpoint name must not"),
    "filename-slash": ({"filename": "a/b"}, r"filename='a/b'"),
    "save-top-k-text": ({"save_top_k": "abc"}, r"save_top_k='abc' must be an integer"),
    "save-top-k-below-minus-1": ({"save_top_k": -2}, r"save_top_k=-2 must be an integer"),
    "mode": ({"mode": "maximum"}, r"mode='maximum' must be 'min' or 'max'"),
}


@pytest.mark.parametrize("case", list(CHECKPOINT_SETTING_CASES))
def test_checkpoint_settings_it_would_misread_are_refused(tmp_path, case):
    params, pattern = CHECKPOINT_SETTING_CASES[case]
    with pytest.raises(ConfigError, match=pattern):
        manage(tmp_path / "run", **params)
    assert not (tmp_path / "run").exists()


def test_a_log_dir_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "run").write_text("notes")
    with pytest.raises(ConfigError, match=r"the log directory .*run .* is a file"):
        manage(tmp_path / "run")
    assert (tmp_path / "run").read_text() == "notes"


@pytest.mark.parametrize("key, module", [("create_wandb_logger", "wandb"),
                                         ("create_tensorboard_logger", "torch.utils.tensorboard")])
def test_a_logger_whose_package_is_missing_is_refused(tmp_path, monkeypatch, key, module):
    monkeypatch.setitem(sys.modules, module, None)  # import raises ImportError, as with the package absent
    exp = OmegaConf.create({"explicit_log_dir": str(tmp_path / "run"), "create_tensorboard_logger": False, key: True})
    with pytest.raises(ConfigError, match=rf"exp_manager.{key}=True needs the .* package .*exp_manager.{key}=False"):
        exp_manager(exp, OmegaConf.create({"model": {"lr": 1}}))
    assert not (tmp_path / "run").exists()


def test_hparams_are_written_only_once_the_run_logs(tmp_path):
    log_dir = tmp_path / "run"
    log_dir.mkdir()
    (log_dir / "hparams.yaml").write_text("the previous run's\n")
    exp = manage(log_dir)  # a run that then fails while building its model or data
    assert (log_dir / "hparams.yaml").read_text() == "the previous run's\n"
    exp.logger.log_metrics({"loss": 1.0}, step=1)
    assert "lr: 1" in (log_dir / "hparams.yaml").read_text()
    exp.logger.finalize()
