"""megatron-core's import-time torch.compile decorators compile on first call instead."""

import json
import subprocess
import sys

import pytest
import torch

from conftest import subprocess_env
from nemo_aligner.utils.patches.deferred_compile import (ModuleOnFirstUse, compile_on_first_call, deferred_modules,
                                                          deferred_torch_compile)


class RecordingCompile:
    """A fake ``torch.compile`` that records what it compiled and marks the results."""

    def __init__(self):
        self.calls = []

    def __call__(self, model, **options):
        self.calls.append((model, options))
        if isinstance(model, torch.nn.Module):
            return ("compiled module", model)

        def compiled(*args, **kwargs):
            return ("compiled", model(*args, **kwargs))

        return compiled


def test_functions_compile_once_on_their_first_call():
    real = RecordingCompile()
    deferred = compile_on_first_call(real)

    def double(x):
        return 2 * x

    fn = deferred(double)
    with_options = deferred(mode="max-autotune")(double)
    assert real.calls == []  # decorating compiles nothing
    assert fn.__name__ == "double" and fn.__wrapped_uncompiled__ is double
    assert fn(3) == ("compiled", 6) and fn(4) == ("compiled", 8)
    assert real.calls == [(double, {})]  # once, for both calls
    assert with_options(1) == ("compiled", 2) and real.calls[1] == (double, {"mode": "max-autotune"})
    module = torch.nn.Linear(2, 2)
    assert deferred(module, dynamic=True) == ("compiled module", module)  # not a function: at once
    assert real.calls[2] == (module, {"dynamic": True})


def test_methods_and_calls_inside_a_compiled_caller(monkeypatch):
    real = RecordingCompile()
    deferred = compile_on_first_call(real)

    class Gate:
        @deferred
        def apply(self, x):
            return x + 1

    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert Gate().apply(1) == 2 and real.calls == []  # a compiling caller traces the plain function
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: False)
    assert Gate().apply(1) == ("compiled", 2)


def test_torch_compile_is_restored_after_the_block():
    real = torch.compile
    with deferred_torch_compile():
        assert torch.compile is not real
    assert torch.compile is real
    try:
        with deferred_torch_compile():
            raise KeyError("x")
    except KeyError:
        pass
    assert torch.compile is real


@pytest.mark.stack
def test_importing_megatron_core_leaves_the_compiler_unimported():
    """In a fresh process: nemo_aligner installs the hook, megatron-core imports without torch._dynamo,
    its fusion kernels are deferred, and torch.compile is the real one again afterwards; neither
    megatron-core nor the CPU patches (which import its inference modules) import wandb."""
    code = """
import json, sys
import nemo_aligner, torch
real = torch.compile
import megatron.core
from megatron.core.models.gpt import GPTModel
from megatron.core.fusions import fused_bias_swiglu
from megatron.core.inference.contexts import dynamic_context
got = {"dynamo": "torch._dynamo" in sys.modules, "restored": torch.compile is real,
       "deferred": hasattr(fused_bias_swiglu.swiglu, "__wrapped_uncompiled__"),
       "hooks_left": [type(f).__name__ for f in sys.meta_path if "Megatron" in type(f).__name__],
       "wandb_imported": "wandb" in sys.modules, "have_wandb": getattr(dynamic_context, "HAVE_WANDB", True)}
from nemo_aligner.utils import patches
patches.apply()  # on a CPU it imports megatron-core's inference engines (the dynamic one imports wandb)
got["wandb_after_patches"] = "wandb" in sys.modules
import wandb
# megatron-core 0.16 imports wandb here: the stand-in's first read imports the real module
version = getattr(dynamic_context, "wandb", wandb).__version__
got["same_wandb"] = version == wandb.__version__ and type(wandb).__name__ == "module"
print(json.dumps(got))
"""
    out = subprocess.run([sys.executable, "-c", code], env=subprocess_env(), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    # torch itself imported the compiler from torch.distributed.tensor.parallel up to 2.6 (megatron-core
    # imports that module): there nothing is left for the deferral to save
    torch_imports_it = subprocess.run(
        [sys.executable, "-c", "import sys, torch.distributed.tensor.parallel; print('torch._dynamo' in sys.modules)"],
        env=subprocess_env(), capture_output=True, text=True, timeout=120).stdout.strip() == "True"
    assert got == {"dynamo": torch_imports_it, "restored": True, "deferred": True, "hooks_left": [], "wandb_imported": False,
                   "have_wandb": True, "wandb_after_patches": False, "same_wandb": True}, got


def test_a_deferred_module_imports_on_first_read(tmp_path, monkeypatch):
    (tmp_path / "late_module.py").write_text("import sys\nsys.late_imports = getattr(sys, 'late_imports', 0) + 1\n"
                                             "VALUE = 7\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "late_module", raising=False)
    with deferred_modules("late_module", "no_such_module_here"):
        import late_module

        assert isinstance(late_module, ModuleOnFirstUse) and late_module.__file__.endswith("late_module.py")
        assert getattr(sys, "late_imports", 0) == 0  # imported nothing yet
        try:
            import no_such_module_here  # noqa: F401
        except ImportError:
            pass
        else:
            raise AssertionError("a module that is not installed must stay unimportable")
        assert late_module.VALUE == 7 and sys.late_imports == 1  # the first read imports it, once
        assert late_module.VALUE == 7 and sys.late_imports == 1
        assert not isinstance(sys.modules["late_module"], ModuleOnFirstUse)
    assert sys.modules["late_module"].VALUE == 7  # the real module stays
    del sys.late_imports
    with deferred_modules("late_module_unused"):
        pass
    with deferred_modules("json"):  # already imported: left alone
        assert not isinstance(sys.modules["json"], ModuleOnFirstUse)
    (tmp_path / "late_module_unused.py").write_text("")
    with deferred_modules("late_module_unused"):
        assert isinstance(sys.modules["late_module_unused"], ModuleOnFirstUse)
    assert "late_module_unused" not in sys.modules  # unused: the stand-in is gone
