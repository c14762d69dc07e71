"""Benchmark results are written per device, with the device named inside; benchmarks leave no scratch files."""

import json
import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
common = pytest.importorskip("common")


@pytest.mark.parametrize("model, threads, slug", [
    ("Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz", 2, "cpu-intel-xeon-platinum-8481c-2t"),
    ("AMD EPYC 9B14", 16, "cpu-amd-epyc-9b14-16t"),
])
def test_device_slug_names_the_cpu_and_its_threads(monkeypatch, model, threads, slug):
    monkeypatch.setattr(common.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(common, "cpu_model", lambda: model)
    monkeypatch.setattr(common.torch, "get_num_threads", lambda: threads)
    assert common.device_slug() == slug


def test_device_slug_of_a_gpu(monkeypatch):
    monkeypatch.setattr(common.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(common.torch.cuda, "get_device_name", lambda: "NVIDIA H100 80GB HBM3")
    assert common.device_slug() == "nvidia-h100-80gb-hbm3"


def test_write_json_puts_the_device_first_and_leaves_no_temporary_file(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "device_description", lambda: "CPU test, 2 threads")
    path = common.write_json("grpo", {"ratio": 0.5}, out_dir=str(tmp_path))
    assert json.load(open(path)) == {"device": "CPU test, 2 threads", "ratio": 0.5}
    assert os.listdir(tmp_path) == ["grpo.json"]


def test_large_shape_is_a_1b_grouped_query_model():
    """The ~1B GPU shape keeps its query groups; the others default to one group per head."""
    large, small = common.model_cfg("large", 1024), common.model_cfg("small", 256)
    assert large["num_query_groups"] == 4 and small["num_query_groups"] is None
    h, f, layers, heads = large["hidden_size"], large["ffn_hidden_size"], large["num_layers"], large["num_attention_heads"]
    kv = 2 * h * (h // heads) * large["num_query_groups"]
    params = layers * (2 * h * h + kv + 3 * h * f) + 2 * 384 * h  # byte vocabulary padded to 384, untied
    assert 0.9e9 < params < 1.1e9


@pytest.mark.parametrize("ending", ["return", "raise SystemExit('benchmark failed')"])
def test_scratch_dir_is_removed_when_the_benchmark_exits(tmp_path, ending):
    """A benchmark's checkpoints and runs (hundreds of MB) go when its process ends, also on failure."""
    script = (f"import os, sys; sys.path.insert(0, {os.path.dirname(common.__file__)!r}); import common\n"
              f"def main():\n"
              f"    work = common.scratch_dir('bench_x_')\n"
              f"    os.makedirs(os.path.join(work, 'run0'))\n"
              f"    open(os.path.join(work, 'run0', 'model.nemo'), 'w').write('x')\n"
              f"    print(work, flush=True)\n"
              f"    {ending}\n"
              f"main()\n")
    env = dict(os.environ, TMPDIR=str(tmp_path))
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    work = done.stdout.strip()
    assert work.startswith(str(tmp_path)) and os.path.basename(work).startswith("bench_x_")
    assert not os.path.exists(work) and os.listdir(tmp_path) == []
