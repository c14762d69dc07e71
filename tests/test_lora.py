"""LoRA (``model.peft.peft_scheme=lora``): the adapter maths against a dense reference, generation with
adapters, TP=2 and PP=2 runs equal to one process, adapters-only (NeMo's PEFT layout) and merged .nemo
files, training checkpoints holding only the trained tensors, and the roles that keep a second set of
weights (reference policy, the critic's reward model) copying only the adapters."""

import io
import json
import math
import os
import re
import shutil
import tarfile

import pytest
import torch
import yaml
from omegaconf import OmegaConf

from conftest import TINY_ARCH, forward_logits, read_metrics, run_script, tiny_optim, train_losses, val_losses

LORA = ["model.peft.peft_scheme=lora", "model.peft.lora_tuning.adapter_dim=8", "model.peft.lora_tuning.alpha=16",
        "model.peft.lora_tuning.target_modules=[all]", "model.peft.lora_tuning.row_init_method=normal"]
ALL_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")


def lora_model_cfg(**tuning):
    return OmegaConf.create(dict(TINY_ARCH, micro_batch_size=2, global_batch_size=2, encoder_seq_length=32,
                                 peft={"peft_scheme": "lora", "lora_tuning": tuning}))


def _linears(layer):
    return {"linear_qkv": layer.self_attention.linear_qkv, "linear_proj": layer.self_attention.linear_proj,
            "linear_fc1": layer.mlp.linear_fc1, "linear_fc2": layer.mlp.linear_fc2}


MOE = dict(num_moe_experts=4, moe_router_topk=2)


def test_lora_on_a_mixture_of_experts_model(mcore_single):
    """``all`` targets on a routed model: one adapter per expert on its fc1/fc2 (NeMo's lora_moe_* adapters;
    none on the router or the shared expert). The logits equal a model without adapters whose weights hold
    W + scale B A (set here by hand), only adapters get gradients, generation sees the adapters, and NeMo's
    file layout (expert i's adapter at local_experts.i ... expert_adapters.i) loads back; the entries NeMo
    keeps for the other experts are not read."""
    from nemo_aligner.models.nlp.gpt import lora
    from nemo_aligner.models.nlp.gpt.megatron_gpt_model import MegatronGPTModel
    from nemo_aligner.models.nlp.gpt.text_generation import generate_texts
    from nemo_aligner.utils.tokenizers import ByteTokenizer

    moe = dict(MOE, moe_shared_expert_intermediate_size=32)
    torch.manual_seed(0)
    cfg = OmegaConf.merge(lora_model_cfg(target_modules=["all"], adapter_dim=4, alpha=8, row_init_method="normal"),
                          moe)
    model = MegatronGPTModel(cfg, ByteTokenizer())
    torch.manual_seed(0)
    plain = MegatronGPTModel(OmegaConf.merge(OmegaConf.create(dict(cfg, peft=None)), moe), ByteTokenizer())
    trained = model.trainable_names()
    # per layer: attention qkv and proj, 4 experts x (fc1, fc2); two tensors each
    assert len(trained) == 2 * 2 * (2 + 8), trained
    assert sum(".mlp.experts.local_experts." in n and ".lora_moe_hto4h_adapter." in n for n in trained) == 16
    assert not any("router" in n or "shared" in n for n in trained)
    tokens = torch.randint(0, 250, (3, 16))
    base = forward_logits(plain, tokens)
    with lora.adapters_disabled(model.module):
        torch.testing.assert_close(forward_logits(model, tokens), base, atol=1e-5, rtol=1e-5)

    # The reference: the plain model's weights + scale * B @ A, written here from the adapters' tensors.
    pairs = []
    for ours, theirs in zip(model.module.decoder.layers, plain.module.decoder.layers):
        pairs += [(ours.self_attention.linear_qkv, theirs.self_attention.linear_qkv),
                  (ours.self_attention.linear_proj, theirs.self_attention.linear_proj)]
        for e, p in zip(ours.mlp.experts.local_experts, theirs.mlp.experts.local_experts):
            pairs += [(e.linear_fc1, p.linear_fc1), (e.linear_fc2, p.linear_fc2)]
    assert len(pairs) == 20
    with torch.no_grad():
        for ours, theirs in pairs:
            adapter = ours.__dict__["lora_adapter"]
            assert adapter.linear_out.weight.abs().sum() > 0
            theirs.weight += (8 / 4) * adapter.linear_out.weight @ adapter.linear_in.weight
    with_adapters = forward_logits(model, tokens)
    assert (with_adapters - base).abs().max() > 1e-2
    torch.testing.assert_close(with_adapters, forward_logits(plain, tokens), atol=1e-5, rtol=1e-5)

    # The experts' adapters get gradients from the tokens routed to them; nothing else does.
    model.module.train()
    positions = torch.arange(16).unsqueeze(0).expand_as(tokens)
    model.module(tokens, positions, None).float().pow(2).mean().backward()
    experts = list(model.module.decoder.layers[0].mlp.experts.local_experts)
    # (megatron-core's DDP moves each gradient into the parameter's main_grad buffer)
    grads = [e.adapter_layer["lora_moe_4htoh_adapter"].linear_in.weight.main_grad for e in experts]
    assert sum(bool(g.abs().sum() > 0) for g in grads) >= 2
    assert all(p.grad is None and getattr(p, "main_grad", None) is None
               for n, p in model.module.named_parameters() if n not in trained)
    model.module.eval()

    prompts = ["reverse abc = ", "add 2 3 = "]
    assert generate_texts(model, prompts) == generate_texts(plain, prompts)

    state = lora.nemo_adapter_state(model.module)
    key = "model.decoder.layers.1.mlp.experts.local_experts.3.adapter_layer.lora_moe_hto4h_adapter.expert_adapters.3."
    assert key + "linear_in.weight" in state and key + "linear_out.weight" in state
    assert len(state) == len(trained)
    cfg.seed = 7
    fresh = MegatronGPTModel(cfg, ByteTokenizer())
    fresh.module.load_state_dict({k: v for k, v in model.module.state_dict().items() if lora.ADAPTER_TAG not in k},
                                 strict=False)  # the same base weights, other adapters
    assert (forward_logits(fresh, tokens) - with_adapters).abs().max() > 1e-3
    nemo_file = dict(state)
    for k, v in state.items():  # NeMo's unused entries: expert i's list holds adapters for the others too
        if ".expert_adapters." in k:
            i = k.split(".expert_adapters.")[1].split(".")[0]
            nemo_file[k.replace(f".expert_adapters.{i}.", f".expert_adapters.{(int(i) + 1) % 4}.")] = v + 1.0
    assert lora.load_nemo_adapters(fresh.module, {(0, 0): nemo_file}, 1, 1, 2, "test") == len(state)
    torch.testing.assert_close(forward_logits(fresh, tokens), with_adapters, atol=1e-6, rtol=1e-6)


def test_lora_on_experts_with_expert_parallelism_matches_one_process(tmp_path):
    """model.expert_model_parallel_size=2 with adapters on the experts: two ranks (each holding 2 of the 4
    experts and their adapters) give one process's loss, gradient norm and loss after an Adam step; the
    adapters file they write holds every expert's adapters, keyed as one process keys them, and it
    loads back at EP=2."""
    from conftest import WORKERS, run_python

    worker = os.path.join(WORKERS, "parallel_loss_worker.py")
    base = tmp_path / "base.nemo"  # one set of base weights for every run (random ones differ per EP rank)
    run_python(worker, ["--random-arch", json.dumps(dict(TINY_ARCH, **MOE)), "--save", base,
                        "--out", tmp_path / "base.json"])
    common = ["--nemo", base, "--lora", "mlp"]
    run_python(worker, common + ["--out", tmp_path / "one.json", "--save", tmp_path / "one.nemo"], like_nproc=2)
    run_python(worker, common + ["--ep", "2", "--out", tmp_path / "two.json", "--save", tmp_path / "two.nemo"],
               nproc=2)
    one, two = (json.loads((tmp_path / name).read_text()) for name in ("one.json", "two.json"))
    for key in ("loss0", "grad_norm", "loss1"):
        assert two[key] == pytest.approx(one[key], rel=1e-6), key
    saved = {n: _adapter_file(tmp_path / f"{n}.nemo") for n in ("one", "two")}
    assert len(saved["two"]) == 2 * 4 * 2 * 2 and saved["two"].keys() == saved["one"].keys()
    assert all(torch.equal(saved["two"][k], v) for k, v in saved["one"].items())
    # restored at EP=2 into adapters seeded otherwise: the first run's loss again
    run_python(worker, common + ["--ep", "2", "--seed", "7", "--out", tmp_path / "other.json"], nproc=2)
    run_python(worker, common + ["--ep", "2", "--seed", "7", "--lora-restore", tmp_path / "two.nemo",
                                 "--out", tmp_path / "restored.json"], nproc=2)
    other, restored = (json.loads((tmp_path / n).read_text()) for n in ("other.json", "restored.json"))
    assert other["loss0"] != pytest.approx(two["loss0"], rel=1e-6)
    assert restored["loss0"] == pytest.approx(two["loss0"], rel=1e-6)


@pytest.mark.stack
def test_adapters_add_the_scaled_low_rank_update_and_only_they_train(mcore_single):
    from nemo_aligner.models.nlp.gpt import lora
    from nemo_aligner.models.nlp.gpt.megatron_gpt_model import MegatronGPTModel
    from nemo_aligner.models.nlp.gpt.text_generation import generate_texts
    from nemo_aligner.utils.tokenizers import ByteTokenizer

    torch.manual_seed(0)
    cfg = lora_model_cfg(target_modules=["all"], adapter_dim=4, alpha=16, row_init_method="normal", layer_selection=[2])
    model = MegatronGPTModel(cfg, ByteTokenizer())
    first, second = model.module.decoder.layers
    assert getattr(first.self_attention, "adapter_layer", None) is None  # layer_selection: layer 2 only
    trained = model.trainable_names()
    assert len(trained) == 8 and all(".adapter_layer." in n for n in trained), trained
    assert not any(p.requires_grad for n, p in model.module.named_parameters() if n not in trained)

    for name, linear in _linears(second).items():
        adapter = linear.__dict__["lora_adapter"]
        a, b = adapter.linear_in.weight.detach(), adapter.linear_out.weight.detach()
        assert a.shape[0] == 4 and b.shape[1] == 4 and b.abs().sum() > 0, name
        x = torch.randn(5, 3, linear.weight.shape[1])
        out, bias = linear(x)
        dense = x @ (linear.weight.detach() + (16 / 4) * b @ a).T  # scale alpha / adapter_dim
        torch.testing.assert_close(out.detach(), dense, atol=1e-5, rtol=1e-5)
        with lora.adapters_disabled(model.module):
            torch.testing.assert_close(linear(x)[0].detach(), x @ linear.weight.detach().T, atol=1e-5, rtol=1e-5)

    tokens = torch.randint(0, 250, (2, 12))
    with_adapters = forward_logits(model, tokens)
    before = {k: v.clone() for k, v in model.module.state_dict().items() if torch.is_tensor(v)}
    with lora.merged_into_base(model.module):
        merged = forward_logits(model, tokens)
    torch.testing.assert_close(merged, with_adapters, atol=1e-4, rtol=1e-4)
    assert all(torch.equal(v, model.module.state_dict()[k]) for k, v in before.items())  # restored exactly
    with lora.adapters_disabled(model.module):
        assert (forward_logits(model, tokens) - with_adapters).abs().max() > 1e-2

    # Generation (the decode engine reads weights directly) sees the adapters.
    prompts = ["reverse abc = ", "add 2 3 = ", "copy xyz = "]
    texts = generate_texts(model, prompts)
    with lora.merged_into_base(model.module):
        assert generate_texts(model, prompts) == texts
    with lora.adapters_disabled(model.module):
        assert generate_texts(model, prompts) != texts


@pytest.mark.stack
def test_nemo_adapter_layout_across_tp_and_pp(mcore_single):
    """NeMo's PEFT files split linear_in by rows (column-parallel layers) or columns (row-parallel ones) and
    linear_out by rows, one file per TP/PP rank with stage-local layer numbers: files of a TP=2 or PP=2 run
    (cut here from a TP=1 model by those rules) load back into the same adapters, gated fc1 included."""
    from nemo_aligner.models.nlp.gpt import lora
    from nemo_aligner.models.nlp.gpt.megatron_gpt_model import MegatronGPTModel
    from nemo_aligner.utils.tokenizers import ByteTokenizer

    torch.manual_seed(0)
    cfg = lora_model_cfg(target_modules=["all"], adapter_dim=4, row_init_method="normal")
    state = lora.nemo_adapter_state(MegatronGPTModel(cfg, ByteTokenizer()).module)
    cfg.seed = 7  # other starting adapters, overwritten by the load
    fresh = MegatronGPTModel(cfg, ByteTokenizer())
    assert not torch.equal(lora.nemo_adapter_state(fresh.module)[next(iter(state))], state[next(iter(state))])

    def tp_part(key, value, rank):
        column = "lora_kqv_adapter" in key or "lora_hto4h_adapter" in key
        if key.endswith("linear_in.weight"):
            return value.chunk(2, dim=0 if column else 1)[rank]
        if "lora_hto4h_adapter" in key:  # gated fc1: each rank's rows are its gate rows then its up rows
            gate, up = value.chunk(2, dim=0)
            return torch.cat([gate.chunk(2)[rank], up.chunk(2)[rank]])
        return value.chunk(2, dim=0)[rank]

    tp2 = {(r, 0): {k: tp_part(k, v, r) for k, v in state.items()} for r in range(2)}
    pp2 = {(0, p): {k.replace(f"layers.{p}.", "layers.0."): v for k, v in state.items() if f"layers.{p}." in k}
           for p in range(2)}
    for saved, tp, pp in ((tp2, 2, 1), (pp2, 1, 2)):
        joined = lora.join_nemo_adapter_files(saved, tp, pp, 2, True, "test")  # what the converters read
        assert joined.keys() == state.keys() and all(torch.equal(joined[k], v) for k, v in state.items())
        assert lora.load_nemo_adapters(fresh.module, saved, tp, pp, 2, "test") == len(state)
        loaded = lora.nemo_adapter_state(fresh.module)
        assert all(torch.equal(loaded[k], v) for k, v in state.items()), (tp, pp)
        cfg.seed = 11
        fresh = MegatronGPTModel(cfg, ByteTokenizer())


def test_damaged_adapter_files_are_refused_in_one_line(mcore_single, tmp_path):
    """An adapters-only .nemo whose weights file holds something else than named float tensors, or a NaN,
    is refused naming the file and entry (or tensor); an intact one loads."""
    from nemo_aligner.models.nlp.gpt.loading import load_model
    from nemo_aligner.models.nlp.gpt.megatron_gpt_model import MegatronGPTModel
    from nemo_aligner.utils import nemo_file
    from nemo_aligner.utils.errors import CheckpointError
    from nemo_aligner.utils.tokenizers import ByteTokenizer

    tuning = {"adapter_dim": 4, "target_modules": ["attention_qkv"], "row_init_method": "normal"}
    good = nemo_file.save_nemo(MegatronGPTModel(lora_model_cfg(**tuning), ByteTokenizer()), str(tmp_path / "a.nemo"))
    state = _adapter_file(good)
    key = next(iter(state))

    def damaged(name, weights):
        """A copy of the good file with its weights (or, given a dict with the config's keys, its config) replaced."""
        member_name = "./model_config.yaml" if isinstance(weights, dict) and "num_layers" in weights else \
            "./model_weights.ckpt"
        buffer = io.BytesIO()
        if member_name.endswith(".yaml"):
            buffer.write(yaml.safe_dump(weights).encode())
        else:
            torch.save(weights, buffer)
        out = tmp_path / f"{name}.nemo"
        with tarfile.open(good) as src, tarfile.open(out, "w:") as dst:
            for member in src.getmembers():
                data = src.extractfile(member).read()
                if member.name == member_name:
                    data = buffer.getvalue()
                member.size = len(data)
                dst.addfile(member, io.BytesIO(data))
        return out

    def load(path):
        cfg = lora_model_cfg(**tuning)
        cfg.peft.restore_from_path = str(path)
        return load_model(MegatronGPTModel, cfg, "32", None, trainable=False)

    load(damaged("same", state))
    cases = [("list", [1, 2], r"model_weights\.ckpt holds a list, not a dict of adapter tensors"),
             ("text", dict(state, **{key: "abc"}), rf"entry '{re.escape(key)}' is a str, not a floating-point"),
             ("ints", dict(state, **{key: torch.ones(2, dtype=torch.long)}), r"is a Tensor of torch\.int64, not a"),
             ("nan", dict(state, **{key: torch.full_like(state[key], float("nan"))}),
              r"holds a NaN or an infinity; the adapters are damaged")]
    config = yaml.safe_load(tarfile.open(good).extractfile("./model_config.yaml").read())
    for value in ("abc", -1, 1.5, [2]):
        cases.append((f"tp{value}", dict(config, tensor_model_parallel_size=value),
                      rf"model_config\.yaml tensor_model_parallel_size={re.escape(repr(value))} is not a model-"))
    for name, weights, message in cases:
        with pytest.raises(CheckpointError, match=message) as err:
            load(damaged(name, weights))
        assert "\n" not in str(err.value) and "model.peft.restore_from_path=" in str(err.value), name


def _sft(tmp_path, name, base, data, extra, nproc=1, steps=12):
    log_dir = tmp_path / name
    run_script("train_gpt_sft.py", [
        f"model.restore_from_path={base}", f"model.data.train_ds.file_path={data['sft_train']}",
        f"model.data.validation_ds.file_path={data['sft_val']}", f"exp_manager.explicit_log_dir={log_dir}",
        f"trainer.sft.max_steps={steps}", "trainer.sft.max_epochs=100", "trainer.sft.val_check_interval=6",
        "trainer.sft.val_at_start=True", "model.optim.lr=2e-2",
        "model.optim.sched.name=Constant", "model.optim.sched.warmup_steps=0", "model.data.train_ds.global_batch_size=8",
        "model.data.train_ds.micro_batch_size=4", "exp_manager.create_checkpoint_callback=True", *LORA, *extra],
        nproc=nproc)
    return log_dir


def _adapter_file(nemo, member="model_weights.ckpt"):
    with tarfile.open(nemo) as tar:
        return torch.load(io.BytesIO(tar.extractfile(f"./{member}").read()), weights_only=True)


def test_lora_sft_learns_matches_at_tp2_and_saves_adapters(tmp_path, base_nemo, builtin_data, mcore_single):
    from nemo_aligner.models.nlp.gpt.loading import load_model
    from nemo_aligner.models.nlp.gpt.megatron_gpt_model import MegatronGPTModel
    from nemo_aligner.utils import nemo_file
    from nemo_aligner.utils.checkpoint_io import checkpoint_shapes

    base = base_nemo[0]
    one = _sft(tmp_path, "tp1", base, builtin_data, [])
    two = _sft(tmp_path, "tp2", base, builtin_data, ["trainer.devices=2", "model.tensor_model_parallel_size=2"], nproc=2)
    val = val_losses(one)
    assert val[12] < val[6] < val[0] - 0.4, val  # the frozen random model learns through its adapters alone
    assert train_losses(two) == pytest.approx(train_losses(one), rel=1e-4)
    assert val_losses(two) == pytest.approx(val, rel=1e-4)

    # Training checkpoints: the adapters and their optimizer state only; a run resumed from step 6 (the
    # frozen base from model.restore_from_path) continues exactly.
    ckpt = next(p for p in (one / "checkpoints").iterdir() if "step=12" in p.name and p.is_dir())
    keys = list(checkpoint_shapes(str(ckpt)))
    assert keys and all(".adapter_layer." in k for k in keys), keys[:5]
    assert any(k.startswith("optimizer.") for k in keys)
    resumed = tmp_path / "resumed"
    shutil.copytree(one, resumed, ignore=lambda d, names: [n for n in names if "step=12" in n or n.endswith(".nemo")
                                                          or n in ("metrics.jsonl", "hparams.yaml")])
    _sft(tmp_path, "resumed", base, builtin_data, [])
    assert train_losses(resumed) == pytest.approx({s: v for s, v in train_losses(one).items() if s > 6}, rel=1e-5)

    # The final .nemo: NeMo's PEFT layout, one file per model-parallel rank, NeMo's key names.
    nemos = {n: d / "checkpoints" / "megatron_gpt_sft.nemo" for n, d in (("one", one), ("two", two))}
    assert sorted(nemo_file.list_members(str(nemos["one"]))) == ["model_config.yaml", "model_weights.ckpt"]
    assert "mp_rank_01/model_weights.ckpt" in nemo_file.list_members(str(nemos["two"]))
    saved = _adapter_file(nemos["one"])
    assert "model.decoder.layers.1.self_attention.adapter_layer.lora_kqv_adapter.linear_in.weight" in saved
    assert "model.decoder.layers.1.mlp.adapter_layer.lora_4htoh_adapter.linear_out.weight" in saved
    assert len(saved) == 16
    assert nemo_file.read_model_config(str(nemos["one"])).peft.peft_scheme == "lora"

    # Adapters saved at TP=2 load at TP=1 into the same model; the merged .nemo is that model.
    def cfg(adapters, merge=False):
        tuning = {"adapter_dim": 8, "alpha": 16, "target_modules": ["all"]}
        return OmegaConf.create({"peft": {"peft_scheme": "lora", "restore_from_path": str(adapters),
                                          "merge_on_save": merge, "lora_tuning": tuning}})

    tokens = torch.randint(0, 250, (2, 16))
    logits = {n: forward_logits(load_model(MegatronGPTModel, cfg(p), "32", base, trainable=False), tokens)
              for n, p in nemos.items()}
    # (two trainings whose losses agree to 1e-4: their adapters differ by float rounding)
    torch.testing.assert_close(logits["two"], logits["one"], atol=1e-3, rtol=1e-3)
    model = load_model(MegatronGPTModel, cfg(nemos["two"], merge=True), "32", base, trainable=False)
    merged_path = nemo_file.save_nemo(model, str(tmp_path / "merged.nemo"))
    assert "model_weights/metadata.json" in nemo_file.list_members(merged_path)
    assert nemo_file.read_model_config(merged_path).peft.peft_scheme == "none"
    plain = load_model(MegatronGPTModel, OmegaConf.create({}), "32", merged_path, trainable=False)
    assert plain.lora is None
    torch.testing.assert_close(forward_logits(plain, tokens), logits["two"], atol=1e-5, rtol=1e-5)

    # NeMo's merge script's command line: the TP=2 adapters merged at TP=1, the base model found
    # through the adapters' restore_from_path; its inputs and non-LoRA files refused in one line.
    merged_cli = tmp_path / "merged_cli.nemo"
    proc = run_script("merge_lora_weights.py", [f"lora_model_path={nemos['two']}", f"merged_model_path={merged_cli}",
                                                "trainer.precision=32", "trainer.devices=2"])  # ranks started by it
    assert "merged model written to" in proc.stdout and "8 adapters merged" in proc.stdout, proc.stdout
    cli = load_model(MegatronGPTModel, OmegaConf.create({}), "32", str(merged_cli), trainable=False)
    torch.testing.assert_close(forward_logits(cli, tokens), logits["two"], atol=1e-5, rtol=1e-5)
    for args, message in (([f"lora_model_path={base}", f"merged_model_path={tmp_path / 'x.nemo'}"],
                           "peft.peft_scheme='none', not LoRA adapters"),
                          ([f"lora_model_path={nemos['one']}", f"merged_model_path={nemos['one']}"],
                           "is an input of the merge"),
                          ([f"lora_model_path={nemos['one']}", f"merged_model_path={tmp_path / 'x.nemo'}",
                            "trainer.precision=8"], "trainer.precision=8 must be 16, bf16 or 32")):
        bad = run_script("merge_lora_weights.py", args, check=False)
        assert bad.returncode == 1 and message in bad.stderr and "Traceback" not in bad.stderr, bad.stderr[-2000:]
    assert not (tmp_path / "x.nemo").exists()
    # generate_gpt.py with the adapters on the base (model.peft.*) answers as the merged model does
    prompts = "prompts=['reverse abc = ','add 2 3 = ']"

    def answers(args):
        out = run_script("generate_gpt.py", [prompts, "inference.tokens_to_generate=8", *args]).stdout
        return [line for line in out.splitlines() if line.startswith('{"prompt"')]

    adapted = answers([f"gpt_model_file={base}", "model.peft.peft_scheme=lora", "model.peft.lora_tuning.alpha=16",
                       f"model.peft.restore_from_path={nemos['two']}", "model.peft.lora_tuning.adapter_dim=8",
                       "model.peft.lora_tuning.target_modules=[all]"])
    assert len(adapted) == 2 and adapted == answers([f"gpt_model_file={merged_cli}"])

    from nemo_aligner.utils.errors import CheckpointError

    with pytest.raises(CheckpointError, match=r"holds LoRA adapters only \(NeMo's PEFT layout\); give it as "
                                              r"model\.peft\.restore_from_path \(with model\.peft\.peft_scheme=lora "
                                              r"and its lora_tuning settings\), with the base model as "
                                              r"model\.restore_from_path, or merge it"):
        load_model(MegatronGPTModel, OmegaConf.create({}), "32", str(nemos["one"]), trainable=False)
    with pytest.raises(CheckpointError, match=r"model\.peft\.restore_from_path=.* is set but model\.peft\.peft_scheme "
                                              r"is none"):
        load_model(MegatronGPTModel, OmegaConf.create({"peft": {"restore_from_path": str(nemos["one"])}}), "32",
                   base, trainable=False)
    bad = cfg(nemos["one"])
    bad.peft.lora_tuning.adapter_dim = 4
    with pytest.raises(CheckpointError, match=r"adapter model\.decoder\.layers\.0\.self_attention\.adapter_layer\."
                                              r"lora_kqv_adapter\.linear_in\.weight has shape \[8, 64\], not what "
                                              r"model\.peft\.lora_tuning"):
        load_model(MegatronGPTModel, bad, "32", base, trainable=False)


def test_lora_sft_on_a_mixture_of_experts_model(tmp_path, builtin_data, mcore_single):
    """LoRA SFT of a frozen random MoE model through adapters on its experts alone (``target_modules=[mlp]``):
    it learns, two expert-parallel ranks train it alike, its training checkpoints hold only the adapters (stacked over experts as megatron-core stacks
    the experts' weights), and its .nemo holds NeMo's per-expert adapter keys, which load back into the
    base model (and merge into it) with the trained model's logits."""
    from conftest import WORKERS, run_python
    from nemo_aligner.models.nlp.gpt.loading import load_model
    from nemo_aligner.models.nlp.gpt.megatron_gpt_model import MegatronGPTModel
    from nemo_aligner.utils import nemo_file
    from nemo_aligner.utils.checkpoint_io import checkpoint_shapes

    base = str(tmp_path / "moe_base.nemo")
    run_python(os.path.join(WORKERS, "parallel_loss_worker.py"),
               ["--random-arch", json.dumps(dict(TINY_ARCH, **MOE)), "--save", base, "--out", str(tmp_path / "r.json")])
    run = _sft(tmp_path, "moe", base, builtin_data, ["model.peft.lora_tuning.target_modules=[mlp]"])
    val = val_losses(run)
    assert val[12] < val[6] < val[0] and val[12] < val[0] - 0.3, val
    # two ranks each holding half the experts and their adapters: the same run
    ep = _sft(tmp_path, "ep2", base, builtin_data, ["model.peft.lora_tuning.target_modules=[mlp]", "trainer.devices=2",
                                                    "++model.expert_model_parallel_size=2"], nproc=2)
    assert train_losses(ep) == pytest.approx(train_losses(run), rel=1e-4)
    assert val_losses(ep) == pytest.approx(val, rel=1e-4)
    assert _adapter_file(ep / "checkpoints" / "megatron_gpt_sft.nemo").keys() == \
        _adapter_file(run / "checkpoints" / "megatron_gpt_sft.nemo").keys()
    ckpt = next(p for p in (run / "checkpoints").iterdir() if "step=12" in p.name and p.is_dir())
    shapes = checkpoint_shapes(str(ckpt))
    assert all(".adapter_layer." in k for k in shapes), list(shapes)[:5]
    expert_key = "model.decoder.layers.mlp.experts.experts.adapter_layer.lora_moe_hto4h_adapter.linear_out.weight"
    assert expert_key in shapes and tuple(shapes[expert_key])[:2] == (2, 4), (expert_key, list(shapes)[:8])
    resumed = tmp_path / "resumed"  # from step 6: the experts' adapters and their optimizer state come back
    shutil.copytree(run, resumed, ignore=lambda d, names: [n for n in names if "step=12" in n or n.endswith(".nemo")
                                                          or n in ("metrics.jsonl", "hparams.yaml")])
    _sft(tmp_path, "resumed", base, builtin_data, ["model.peft.lora_tuning.target_modules=[mlp]"])
    assert train_losses(resumed) == pytest.approx({s: v for s, v in train_losses(run).items() if s > 6}, rel=1e-5)

    nemo = run / "checkpoints" / "megatron_gpt_sft.nemo"
    saved = _adapter_file(nemo)
    assert len(saved) == 2 * 4 * 2 * 2 and all(".mlp.experts.local_experts." in k for k in saved)
    assert ("model.decoder.layers.1.mlp.experts.local_experts.2.adapter_layer.lora_moe_4htoh_adapter."
            "expert_adapters.2.linear_out.weight") in saved
    tuning = {"adapter_dim": 8, "alpha": 16, "target_modules": ["mlp"]}
    peft = {"peft_scheme": "lora", "restore_from_path": str(nemo), "lora_tuning": tuning}
    tokens = torch.randint(0, 250, (2, 16))
    trained = forward_logits(load_model(MegatronGPTModel, OmegaConf.create({"peft": peft}), "32", base,
                                        trainable=False), tokens)
    start = forward_logits(load_model(MegatronGPTModel, OmegaConf.create({}), "32", base, trainable=False), tokens)
    assert (trained - start).abs().max() > 1e-2
    merged = load_model(MegatronGPTModel, OmegaConf.create({"peft": dict(peft, merge_on_save=True)}), "32", base,
                        trainable=False)
    merged_path = nemo_file.save_nemo(merged, str(tmp_path / "merged.nemo"))
    plain = load_model(MegatronGPTModel, OmegaConf.create({}), "32", merged_path, trainable=False)
    torch.testing.assert_close(forward_logits(plain, tokens), trained, atol=1e-5, rtol=1e-5)


def test_lora_dpo_reference_is_the_starting_policy_without_a_weight_copy(tmp_path, quick_sft, builtin_data):
    log_dir = tmp_path / "dpo"
    proc = run_script("train_gpt_dpo.py", [
        f"pretrained_checkpoint.restore_from_path={quick_sft}",
        f"++model.data.data_prefix={{train: [{builtin_data['dpo_train']}], validation: [{builtin_data['dpo_val']}]}}",
        f"exp_manager.explicit_log_dir={log_dir}", "trainer.dpo.max_steps=30", "trainer.dpo.max_epochs=100",
        "trainer.dpo.val_check_interval=30", "model.optim.lr=2e-3", "model.dpo.ref_policy_kl_penalty=0.2",
        "model.peft.peft_scheme=lora",
        "model.peft.lora_tuning.target_modules=[all]"])
    train = [r for r in read_metrics(log_dir) if "train/loss" in r]
    assert train[0]["train/loss"] == pytest.approx(math.log(2), abs=1e-6)  # policy == reference at step 1
    assert train[0]["train/reward_margin"] == pytest.approx(0.0, abs=1e-6)
    assert sum(r["train/loss"] for r in train[-3:]) / 3 < math.log(2) - 0.1, [r["train/loss"] for r in train]
    copy = re.search(r"weight copy holds ([\d.]+) MB \(the trained tensors\) instead of ([\d.]+) MB",
                     proc.stdout + proc.stderr)
    assert copy and float(copy[1]) < float(copy[2]) / 3, copy
    saved = _adapter_file(log_dir / "checkpoints" / "megatron_gpt.nemo")
    assert saved and all(".adapter_layer." in k for k in saved)


def test_lora_reward_model_trains_its_head_with_the_adapters(tmp_path, base_nemo, builtin_data):
    from conftest import rm_overrides

    log_dir = tmp_path / "rm"
    run_script("train_reward_model.py", [f"pretrained_checkpoint.restore_from_path={base_nemo[0]}",
                                         *rm_overrides(builtin_data, log_dir, 2), "model.peft.peft_scheme=lora",
                                         "exp_manager.create_checkpoint_callback=True"])
    saved = _adapter_file(log_dir / "checkpoints" / "megatron_gpt.nemo")
    assert {"model.rm_head.weight", "model.rm_head.bias"} <= set(saved)
    assert sum(".adapter_layer." in k for k in saved) == 4  # qkv adapters of 2 layers


def test_lora_ppo_actor_and_critic(tmp_path, task_data, quick_rm, quick_sft):
    """PPO with LoRA on both the actor (GRPO's and REINFORCE's model too) and the critic (whose co-located
    reward model is kept as a copy of the adapters and head only): the KL to the reference starts at 0."""
    from conftest import run_ppo_local

    critic_dir, actor_dir = tmp_path / "critic", tmp_path / "actor"
    data = f"++model.data.data_prefix={{train: [{task_data['prompts_train']}], validation: [{task_data['prompts_val']}]}}"
    critic = [f"pretrained_checkpoint.restore_from_path={quick_rm}", f"exp_manager.explicit_log_dir={critic_dir}",
              "model.peft.peft_scheme=lora"]
    actor = [f"pretrained_checkpoint.restore_from_path={quick_sft}", data, f"exp_manager.explicit_log_dir={actor_dir}",
             "trainer.ppo.max_steps=2", "trainer.ppo.max_epochs=100", "model.ppo.num_rollout_samples=16",
             "model.global_batch_size=16", "model.micro_batch_size=8", "model.ppo.rollout_micro_batch_size=16",
             "model.ppo.length_params.max_length=9", "model.ppo.num_val_samples=16", "trainer.ppo.save_interval=2",
             *tiny_optim(1e-3, 1e-6, 0), "model.peft.peft_scheme=lora"]
    run_ppo_local(critic, actor, timeout=600, critic_log=tmp_path / "critic.log")
    metrics = [r for r in read_metrics(actor_dir) if "train/init_policy_kl" in r]
    assert metrics[0]["train/init_policy_kl"] == pytest.approx(0.0, abs=1e-6) and metrics[1]["train/init_policy_kl"] != 0
    assert all(".adapter_layer." in k for k in _adapter_file(actor_dir / "checkpoints" / "megatron_gpt_ppo_actor.nemo"))
    critic_log = (tmp_path / "critic.log").read_text()
    assert re.search(r"LoRA: weight copy holds [\d.]+ MB", critic_log), critic_log[-2000:]
    from nemo_aligner.utils.checkpoint_io import checkpoint_shapes

    critic_ckpt = next(p for p in (critic_dir / "checkpoints").iterdir() if p.is_dir() and "step=2" in p.name)
    keys = [k for k in checkpoint_shapes(str(critic_ckpt)) if k.startswith("model.")]
    assert "model.rm_head.weight" in keys and all(".adapter_layer." in k or "rm_head" in k for k in keys), keys


def test_canonical_variant_unfused_adapters(mcore_single):
    """``variant: canonical`` (NeMo's unfused adapters): linear_qkv gets query, key and value adapters each
    with its own A, a gated fc1 gate and up adapters, under NeMo's names; the layer's output equals its
    weight plus each block's ``scale * B A`` placed as the Hugging Face layout fuses q/k/v (grouped-query
    attention: 4 heads, 2 groups) and gate/up; files round-trip across TP=2 cuts; merging gives the same
    logits; dropout sits on the adapter's output unless dropout_position=pre."""
    from nemo_aligner.models.nlp.gpt import lora
    from nemo_aligner.models.nlp.gpt.hf_interop import _fuse_qkv
    from nemo_aligner.models.nlp.gpt.megatron_gpt_model import MegatronGPTModel
    from nemo_aligner.utils.tokenizers import ByteTokenizer

    torch.manual_seed(0)
    cfg = lora_model_cfg(target_modules=["all"], adapter_dim=4, alpha=12, row_init_method="normal",
                         variant="canonical")
    model = MegatronGPTModel(cfg, ByteTokenizer())
    layer = model.module.decoder.layers[1]
    names = sorted(n for n in model.trainable_names() if "layers.1." in n)
    assert sorted(n.split("adapter_layer.")[1] for n in names) == sorted(
        [f"lora_unfused_kqv_adapter.{p}_adapter.linear_{h}.weight" for p in "qkv" for h in ("in", "out")]
        + [f"lora_unfused_hto4h_adapter.{p}_adapter.linear_{h}.weight" for p in ("gate", "up") for h in ("in", "out")]
        + [f"lora_{n}_adapter.linear_{h}.weight" for n in ("dense_attention", "4htoh") for h in ("in", "out")])
    assert len(list(lora.adapters(model.module))) == 8  # one per adapted layer

    def delta(part):
        a, b = part.linear_in.weight.detach(), part.linear_out.weight.detach()
        assert b.abs().sum() > 0
        return (12 / 4) * b @ a

    qkv = layer.self_attention.adapter_layer["lora_unfused_kqv_adapter"]
    q, k, v = (delta(getattr(qkv, f"{p}_adapter")) for p in "qkv")
    assert q.shape == (64, 64) and k.shape == v.shape == (32, 64)
    assert not torch.equal(qkv.q_adapter.linear_in.weight, qkv.k_adapter.linear_in.weight)  # A per block
    fc1 = layer.mlp.adapter_layer["lora_unfused_hto4h_adapter"]
    expected = {"linear_qkv": _fuse_qkv(q, k, v, 4, 2, 16),
                "linear_fc1": torch.cat([delta(fc1.gate_adapter), delta(fc1.up_adapter)])}
    for name in ("linear_qkv", "linear_fc1"):
        linear = _linears(layer)[name]
        x = torch.randn(5, 3, linear.weight.shape[1])
        dense = x @ (linear.weight.detach() + expected[name]).T
        torch.testing.assert_close(linear(x)[0].detach(), dense, atol=1e-5, rtol=1e-5)

    tokens = torch.randint(0, 250, (2, 12))
    with_adapters = forward_logits(model, tokens)
    with lora.merged_into_base(model.module):
        torch.testing.assert_close(forward_logits(model, tokens), with_adapters, atol=1e-4, rtol=1e-4)
    with lora.adapters_disabled(model.module):
        assert (forward_logits(model, tokens) - with_adapters).abs().max() > 1e-2

    state = lora.nemo_adapter_state(model.module)
    assert "model.decoder.layers.0.self_attention.adapter_layer.lora_unfused_kqv_adapter.v_adapter.linear_out.weight" \
        in state and len(state) == 2 * 7 * 2  # layers x adapters (q, k, v, gate, up, dense, fc2) x A, B
    tp2 = {(r, 0): {key: value.chunk(2, dim=1 if "linear_in" in key and ("dense" in key or "4htoh" in key) else 0)[r]
                    for key, value in state.items()} for r in range(2)}
    cfg.seed = 7
    fresh = MegatronGPTModel(cfg, ByteTokenizer())
    assert lora.load_nemo_adapters(fresh.module, tp2, 2, 1, 2, "test") == len(state)
    loaded = lora.nemo_adapter_state(fresh.module)
    assert all(torch.equal(loaded[key], value) for key, value in state.items())

    # dropout: on B A x (NeMo's default) or on x
    for position in ("post", "pre"):
        cfg = lora_model_cfg(target_modules=["attention_dense"], adapter_dim=4, adapter_dropout=0.5,
                             row_init_method="normal", dropout_position=position)
        adapter = MegatronGPTModel(cfg, ByteTokenizer()).module.decoder.layers[0].self_attention.linear_proj \
            .__dict__["lora_adapter"]
        adapter.train()
        x = torch.randn(7, 64)
        dropped = adapter(x) == 0
        assert bool(dropped.any()) == (position == "post")


def test_canonical_variant_at_tp2_matches_one_process(tmp_path):
    """Canonical adapters at TP=2 (each block's B split by its rows, laid out as the rank's query groups
    and gate/up halves): one process's loss, gradient norm and loss after an Adam step; the TP=2 adapters
    file (saved before training) loads into one process as the same adapters: its first loss again."""
    from conftest import WORKERS, run_python

    worker = os.path.join(WORKERS, "parallel_loss_worker.py")
    base = tmp_path / "base.nemo"
    run_python(worker, ["--random-arch", json.dumps(TINY_ARCH), "--save", base, "--out", tmp_path / "base.json"])
    common = ["--nemo", base, "--lora", "all", "--lora-variant", "canonical"]
    run_python(worker, common + ["--out", tmp_path / "one.json", "--save", tmp_path / "one.nemo"], like_nproc=2)
    run_python(worker, common + ["--tp", "2", "--out", tmp_path / "two.json", "--save", tmp_path / "two.nemo"],
               nproc=2)
    run_python(worker, common + ["--seed", "7", "--lora-restore", tmp_path / "two.nemo",
                                 "--out", tmp_path / "restored.json"], like_nproc=2)
    one, two, restored = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("one", "two", "restored"))
    for key in ("loss0", "grad_norm", "loss1"):
        assert two[key] == pytest.approx(one[key], rel=1e-5), key
    assert restored["loss0"] == pytest.approx(two["loss0"], rel=1e-5)  # seed 7's adapters replaced
    from nemo_aligner.models.nlp.gpt.peft_interop import read_nemo_lora

    whole = {n: read_nemo_lora(str(tmp_path / f"{n}.nemo"), n)[2] for n in ("one", "two")}  # TP=2 files joined
    assert len(whole["two"]) == 28 and whole["two"].keys() == whole["one"].keys()
    assert all(torch.equal(whole["two"][k], v) for k, v in whole["one"].items())


def test_adapters_the_settings_place_nowhere_are_refused(mcore_single):
    """A file's adapters that the run's lora_tuning settings do not place (other targets, layers or
    variant) are refused naming one, instead of being dropped."""
    from nemo_aligner.models.nlp.gpt import lora
    from nemo_aligner.models.nlp.gpt.megatron_gpt_model import MegatronGPTModel
    from nemo_aligner.utils.errors import CheckpointError
    from nemo_aligner.utils.tokenizers import ByteTokenizer

    state = lora.nemo_adapter_state(MegatronGPTModel(lora_model_cfg(target_modules=["all"], adapter_dim=4),
                                                     ByteTokenizer()).module)
    for tuning, named in ((dict(target_modules=["attention_qkv"]), "lora_dense_attention_adapter"),
                          (dict(target_modules=["all"], layer_selection=[1]), "layers.1."),
                          (dict(target_modules=["attention"], variant="canonical"), "lora_kqv_adapter")):
        model = MegatronGPTModel(lora_model_cfg(adapter_dim=4, **tuning), ByteTokenizer())
        saved = state
        if tuning.get("variant") == "canonical":  # the canonical blocks present too: only the fused one is extra
            saved = dict(lora.nemo_adapter_state(model.module),
                         **{k: v for k, v in state.items() if "lora_kqv_adapter" in k})
        with pytest.raises(CheckpointError, match=f"holds adapter .*{re.escape(named)}.* place nowhere"):
            lora.load_nemo_adapters(model.module, {(0, 0): saved}, 1, 1, 2, "test")
