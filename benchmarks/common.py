"""Shared pieces of the benchmarks: a model in our engine and the same weights as a Hugging Face
model, the machine's measured matmul peak, timing helpers and result files.

On a machine with a GPU everything runs there (our model through its own device placement, the HF
model moved to it), and timings wait for the GPU (``synchronize``)."""

from __future__ import annotations

import atexit
import json
import os
import platform
import re
import shutil
import statistics
import tempfile
import time
from typing import Callable, Dict, List

import torch

SHAPES = {
    "tiny": dict(num_layers=4, hidden_size=256, ffn_hidden_size=1024, num_attention_heads=4),
    "small": dict(num_layers=12, hidden_size=768, ffn_hidden_size=3072, num_attention_heads=12),
    # for GPUs: the two above leave an H100 mostly idle
    "medium": dict(num_layers=24, hidden_size=1024, ffn_hidden_size=4096, num_attention_heads=16),
    # ~1B (0.97B with the byte vocabulary), TinyLlama's layout: grouped-query attention, 4 groups
    "large": dict(num_layers=22, hidden_size=2048, ffn_hidden_size=5632, num_attention_heads=32, num_query_groups=4),
}


def model_cfg(shape: str, seq: int, micro_batch: int = 8) -> dict:
    """A Llama-shaped model config (RoPE, RMSNorm, SwiGLU, untied embeddings), as the built-in models;
    ``micro_batch`` is its micro- and global batch size."""
    return dict({"num_query_groups": None, **SHAPES[shape]}, encoder_seq_length=seq, max_position_embeddings=seq,
                position_embedding_type="rope", normalization="rmsnorm", activation="swiglu", bias=False,
                share_embeddings_and_output_weights=False, make_vocab_size_divisible_by=128,
                micro_batch_size=micro_batch, global_batch_size=micro_batch, hidden_dropout=0.0, attention_dropout=0.0,
                optim={"name": "fused_adam", "lr": 1e-4, "weight_decay": 0.0, "sched": {"name": "Constant"}})


def scratch_dir(prefix: str) -> str:
    """A new temporary directory for a benchmark's checkpoints and runs, removed when the process exits
    (a GRPO run writes ~230 MB there)."""
    path = tempfile.mkdtemp(prefix=prefix)
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def init_single_process() -> None:
    from nemo_aligner.utils import distributed as D

    D.init_distributed()
    D.initialize_model_parallel(1, 1)


def bench_device() -> torch.device:
    """The GPU when there is one, else the CPU."""
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def synchronize() -> None:
    """Wait for queued GPU work (timings end here); nothing on the CPU."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), or the architecture where it cannot be read:
    ratios depend on it (MKL's small-matrix kernels, for one, are much slower on AMD CPUs)."""
    from nemo_aligner.utils.cpu_gemm import cpuinfo

    return cpuinfo("model name") or platform.processor() or platform.machine()


def device_description() -> str:
    """What the timings ran on, for the printed tables: the GPU's name, or the CPU and its threads."""
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return f"CPU {cpu_model()}, {torch.get_num_threads()} threads, decode GEMM {decode_gemms()}"


def decode_gemms() -> str:
    """The CPU decode GEMM chosen for each precision (they differ: e.g. bf16 on oneDNN where the CPU
    has AMX, float32 on our kernel), e.g. ``native (fp32), onednn (bf16)``."""
    from nemo_aligner.utils.cpu_gemm import decode_gemm_backend

    return f"{decode_gemm_backend(torch.float32)} (fp32), {decode_gemm_backend(torch.bfloat16)} (bf16)"


def versions_line() -> str:
    """``name version, ...`` of the installed packages of both sides, for the printed tables."""
    return ", ".join(f"{name} {v}" for name, v in versions().items() if v)


def default_precision() -> str:
    """bf16 on a GPU (what runs there), float32 on the CPU (this CPU's bf16 matmuls are slower)."""
    return "bf16" if torch.cuda.is_available() else "32"


def build_pair(shape: str, seq: int, model_cls=None, trainable: bool = False, precision: str = "32",
               micro_batch: int = 8):
    """``(our model, the HF model with identical weights)`` in eval mode, on ``bench_device()``;
    ``micro_batch``: ours (see ``model_cfg``).
    ``precision`` is ours (bf16: bf16 weights); the HF model keeps float32 weights (callers use
    autocast or cast it)."""
    import transformers
    from omegaconf import OmegaConf

    from nemo_aligner.models.nlp.gpt.gpt_sft_model import GPTSFTModel
    from nemo_aligner.models.nlp.gpt.hf_interop import hf_config_from_nemo, mcore_to_hf
    from nemo_aligner.utils.tokenizers import ByteTokenizer

    torch.manual_seed(0)
    ours = (model_cls or GPTSFTModel)(OmegaConf.create(model_cfg(shape, seq, micro_batch)), ByteTokenizer(),
                                      precision, trainable=trainable)
    cfg = OmegaConf.to_container(ours.cfg, resolve=True)
    arch, hf_cfg = hf_config_from_nemo(cfg)
    hf_cfg = dict(hf_cfg, vocab_size=cfg["padded_vocab_size"])  # keep the padded rows: identical logits
    config = transformers.AutoConfig.for_model(**hf_cfg)
    hf = transformers.AutoModelForCausalLM.from_config(config)
    state = {k: v.float().cpu() for k, v in ours.module.state_dict().items() if isinstance(v, torch.Tensor)}
    cfg_full = dict(cfg, hf_vocab_size=cfg["padded_vocab_size"])
    missing, unexpected = hf.load_state_dict(mcore_to_hf(state, arch, cfg_full), strict=False)
    assert not unexpected and all("rotary" in k for k in missing), (missing, unexpected)
    return ours, hf.to(bench_device()).eval()


def byte_tokenizer_dir(path: str) -> str:
    """A Hugging Face tokenizer with our byte tokenizer's ids (byte b -> id b, then the specials)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from nemo_aligner.utils.tokenizers import BYTE_SPECIAL_TOKENS

    vocab = {ch: b for b, ch in enumerate(_bytes_to_unicode())}
    vocab.update({tok: 256 + i for i, tok in enumerate(BYTE_SPECIAL_TOKENS)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>")
    fast.save_pretrained(path)
    return path


def _bytes_to_unicode():
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    table = dict(zip(bs, (chr(c) for c in cs)))
    return [table[b] for b in range(256)]


def trainer_step_timer():
    """A Hugging Face ``TrainerCallback`` whose ``seconds`` lists each optimizer step's wall time (on a
    GPU, up to its queued work's end)."""
    from transformers import TrainerCallback

    class StepTimes(TrainerCallback):
        def __init__(self):
            self.seconds, self.start = [], None

        def on_step_begin(self, args_, state, control, **kwargs):
            synchronize()
            self.start = time.perf_counter()

        def on_step_end(self, args_, state, control, **kwargs):
            synchronize()
            self.seconds.append(time.perf_counter() - self.start)

    return StepTimes()


def matmul_peak_gflops(n: int = 2048, repeats: int = 5, dtype: torch.dtype = torch.float32) -> float:
    """Measured ``dtype`` matmul throughput of ``bench_device()`` (best of ``repeats``; n x n x n,
    8192 on a GPU)."""
    device = bench_device()
    n = 8192 if device.type == "cuda" else n
    a, b = torch.randn(n, n, dtype=dtype, device=device), torch.randn(n, n, dtype=dtype, device=device)
    torch.mm(a, b)
    synchronize()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b)
        synchronize()
        best = min(best, time.perf_counter() - start)
    return 2 * n ** 3 / best / 1e9


def memory_bandwidth_gbs(mib: int = None, repeats: int = 5) -> float:
    """Measured memory bandwidth of ``bench_device()`` in GB/s, counting bytes read and written: best
    of ``repeats`` copies of a ``mib`` MiB buffer (1 GiB on a GPU, 256 MiB on the CPU: beyond the caches)."""
    device = bench_device()
    mib = mib or (1024 if device.type == "cuda" else 256)
    src = torch.ones(mib * 2 ** 20 // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    synchronize()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        synchronize()
        best = min(best, time.perf_counter() - start)
    return 2 * src.numel() * src.element_size() / best / 1e9


def alternate(contenders: Dict[str, Callable[[], float]], rounds: int) -> Dict[str, List[float]]:
    """Run each contender once per round, in turn, the order reversed every other round (neither
    always runs first); each call returns its measured seconds."""
    times: Dict[str, List[float]] = {name: [] for name in contenders}
    order = list(contenders)
    for r in range(rounds):
        for name in (order if r % 2 == 0 else order[::-1]):
            times[name].append(contenders[name]())
    return times


def race(run_ours: Callable[[], float], run_hf: Callable[[], float], rounds: int, units: float) -> dict:
    """Warm each up once, alternate ``rounds`` runs, and report ``units`` per second from the median
    time of each (``ours_tok_s``, ``hf_tok_s``), the raw times and ``ratio`` = ours / HF."""
    run_ours(), run_hf()
    times = alternate({"ours": run_ours, "hf": run_hf}, rounds)
    row = {"hf_tok_s": units / median(times["hf"]), "ours_tok_s": units / median(times["ours"]),
           "hf_s": times["hf"], "ours_s": times["ours"]}
    row["ratio"] = row["ours_tok_s"] / row["hf_tok_s"]
    return row


def median(values: List[float]) -> float:
    return statistics.median(values)


def machine() -> dict:
    return {"cpu": platform.processor() or platform.machine(), "cpu_model": cpu_model(),
            "decode_gemm": decode_gemms(), "threads": torch.get_num_threads(),
            "torch": torch.__version__, "cuda": torch.cuda.is_available(),
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None, "versions": versions()}


def versions() -> dict:
    """Installed versions of both sides' packages (None where one is not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for name in ("nemo-aligner", "megatron-core", "torch", "transformers", "trl"):
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = None
    return found


def device_slug() -> str:
    """A folder name for the device the timings ran on: ``nvidia-h100-80gb-hbm3``, or the CPU model
    and its threads (``cpu-amd-epyc-2t``), so results from different machines sit side by side."""
    def clean(text: str) -> str:  # "Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz" -> "intel xeon platinum 8481c"
        return re.sub(r"\((r|tm)\)|\bcpu\b|@.*$", " ", text.lower())

    name = clean(torch.cuda.get_device_name()) if torch.cuda.is_available() else \
        f"cpu {clean(cpu_model())} {torch.get_num_threads()}t"
    return re.sub(r"[^a-z0-9]+", "-", name).strip("-")


def write_json(name: str, payload: dict, out_dir: str = None) -> str:
    """``payload`` (with the device's description added) to ``benchmarks/results/<device>/<name>.json``,
    through a temporary file; prints both sides' package versions (they are in ``machine()``)."""
    out_dir = out_dir or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", device_slug())
    os.makedirs(out_dir, exist_ok=True)
    payload = {"device": device_description(), **payload}
    print("versions:", versions_line())
    path = os.path.join(out_dir, f"{name}.json")
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(payload, f, indent=2)
    os.replace(tmp, path)
    return path
