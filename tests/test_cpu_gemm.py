"""The decode loop's packed CPU matmuls equal ``F.linear``, and the backend is chosen by CPU vendor
unless ``NEMO_ALIGNER_DECODE_GEMM`` names one."""

import pytest
import torch
import torch.nn.functional as F

from nemo_aligner.utils import cpu_gemm
from nemo_aligner.utils.errors import ConfigError

AVAILABLE = [b for b in cpu_gemm.BACKENDS if cpu_gemm.available(b)]


@pytest.mark.parametrize("backend", AVAILABLE)
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_linear_equals_f_linear(backend, with_bias):
    torch.manual_seed(0)
    weight, bias = torch.randn(96, 64), torch.randn(96) if with_bias else None
    rows = 8
    packed = cpu_gemm.pack(weight, rows, backend)
    assert (packed is None) == (backend == "plain")
    call = cpu_gemm.linear(weight, bias, packed, rows, backend)
    # a decode step's [1, rows, in], a smaller batch, a prefill's [S, rows, in], a strided input,
    # and row counts around our kernel's 6-row blocks
    for x in (torch.randn(1, rows, 64), torch.randn(3, 64), torch.randn(16, rows, 64), torch.randn(1, rows, 128)[..., ::2],
              torch.randn(5, 64), torch.randn(7, 64), torch.randn(1, 64)):
        with torch.inference_mode():
            out = call(x)
        assert torch.allclose(out, F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)


def test_only_float32_cpu_matrices_are_packed():
    backend = next((b for b in AVAILABLE if b != "plain"), None)
    if backend is None:
        pytest.skip("this torch build has no packed GEMM")
    assert cpu_gemm.pack(torch.randn(4, 4, dtype=torch.bfloat16), 2, backend) is None
    assert cpu_gemm.pack(torch.randn(4), 2, backend) is None
    assert cpu_gemm.pack(torch.randn(4, 4), 2, backend) is not None


@pytest.mark.parametrize("machine,vendor,expected,without_native", [
    ("x86_64", "GenuineIntel", "mkl", "mkl"),
    ("x86_64", "AuthenticAMD", "native", "onednn"),
    ("x86_64", "", "native", "onednn"),
    ("aarch64", "", "plain", "plain"),
])
def test_auto_choice_follows_the_cpu(monkeypatch, machine, vendor, expected, without_native):
    monkeypatch.delenv(cpu_gemm.ENV_VAR, raising=False)
    monkeypatch.setattr(cpu_gemm.platform, "machine", lambda: machine)
    monkeypatch.setattr(cpu_gemm, "cpu_vendor", lambda: vendor)
    monkeypatch.setattr(cpu_gemm, "available", lambda b: True)
    assert cpu_gemm.decode_gemm_backend() == expected
    # where our kernels do not build (no compiler, no AVX2), oneDNN as before
    monkeypatch.setattr(cpu_gemm, "available", lambda b: b != "native")
    assert cpu_gemm.decode_gemm_backend() == without_native
    # a build without the preferred library falls back to plain matmuls
    monkeypatch.setattr(cpu_gemm, "available", lambda b: b == "plain")
    assert cpu_gemm.decode_gemm_backend() == "plain"


def test_environment_override_and_its_errors(monkeypatch):
    for backend in AVAILABLE:
        monkeypatch.setenv(cpu_gemm.ENV_VAR, backend.upper())
        assert cpu_gemm.decode_gemm_backend() == backend
    monkeypatch.setenv(cpu_gemm.ENV_VAR, "blas")
    with pytest.raises(ConfigError, match="NEMO_ALIGNER_DECODE_GEMM='blas'.*auto, native, mkl, onednn, plain"):
        cpu_gemm.decode_gemm_backend()
    monkeypatch.setenv(cpu_gemm.ENV_VAR, "mkl")
    monkeypatch.setattr(cpu_gemm, "available", lambda b: b != "mkl")
    with pytest.raises(ConfigError, match="no mkl packed GEMM"):
        cpu_gemm.decode_gemm_backend()


def test_cpuinfo_fields_of_this_machine():
    vendor = cpu_gemm.cpu_vendor()
    try:
        lines = open("/proc/cpuinfo").read().splitlines()
    except OSError:
        assert vendor == "" and cpu_gemm.cpuinfo("model name") == ""
        return
    first = {}
    for line in lines:
        name, sep, value = line.partition(":")
        if sep:
            first.setdefault(name.strip(), value.strip())
    assert vendor == first.get("vendor_id", "")
    assert cpu_gemm.cpuinfo("model name") == first.get("model name", "")
    assert cpu_gemm.cpuinfo("no such field") == ""
