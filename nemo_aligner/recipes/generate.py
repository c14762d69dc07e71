"""``generate_gpt.py``: prompts (or SteerLM-steered prompts) in, responses out."""

from __future__ import annotations

import json
import os
import re
from typing import List, Optional, Tuple

from omegaconf import DictConfig, OmegaConf, open_dict

from nemo_aligner.data.nlp.jsonl import read_jsonl, write_jsonl
from nemo_aligner.data.nlp.steerlm_labels import format_label, model_chat_tokens, parse_label, steer_prompt
from nemo_aligner.models.nlp.gpt.gpt_sft_model import GPTSFTModel
from nemo_aligner.models.nlp.gpt.loading import load_model
from nemo_aligner.utils.checkpoint_io import checkpoint_dir_named, is_sharded_checkpoint, load_common
from nemo_aligner.utils.distributed import is_global_rank_zero
from nemo_aligner.utils.errors import ConfigError, DataError
from nemo_aligner.models.nlp.gpt.generation import LengthParams, SamplingParams
from nemo_aligner.utils.ports import check_bindable
from nemo_aligner.utils.run_setup import init_run
from nemo_aligner.models.nlp.gpt.text_generation import generate_texts, sentence_logprobs


def _attributes(value, where: str) -> str:
    """A prompt's SteerLM attributes (``{"quality": 4}`` or ``"quality:4"``), checked, as the label
    string the prompt carries; errors name ``where``."""
    if isinstance(value, str):
        parsed = parse_label(value, where)
        if not parsed:
            raise DataError(f"{where}: an empty label; give attributes like 'quality:4'")
        return format_label(parsed)  # as training writes labels: "quality:4", not "quality: 4.0"
    if isinstance(value, dict) and value and all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                                 for v in value.values()):
        return format_label(value)
    raise DataError(f"{where}: must be a label string like 'quality:4' or a mapping of attribute "
                    f"names to numbers, got {value!r}")


_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\"}


def unescape(text: str) -> str:
    """``\\n``, ``\\t``, ``\\r`` and ``\\\\`` as the characters they name: Hydra's command line passes a
    typed ``\\n`` through as two characters, and a newline is the chat template's end of turn."""
    return re.sub(r"\\([ntr\\])", lambda m: _ESCAPES[m.group(1)], text)


def read_prompts(cfg: DictConfig) -> List[Tuple[str, Optional[str]]]:
    """``(prompt, attribute label)`` pairs: ``prompts`` and ``prompts_file`` records, each with its own
    ``attributes`` field if it has one, else ``steerlm.attributes`` (None: not steered)."""
    default = (cfg.get("steerlm") or {}).get("attributes")
    if default is not None:
        default = default if isinstance(default, str) else OmegaConf.to_container(default)
        default = _attributes(default, "steerlm.attributes")
    given = cfg.get("prompts") or []
    if isinstance(given, str):  # prompts='one prompt': one prompt, not one per character
        given = [given]
    for i, p in enumerate(given):
        if not isinstance(p, (str, int, float)) or isinstance(p, bool):
            raise ConfigError(f"prompts[{i}]={p!r} must be text (prompts: a list of strings)")
    prompts = [(str(p), default) for p in given]
    if cfg.get("prompts_file"):
        for record in read_jsonl(cfg.prompts_file):
            where = f"{cfg.prompts_file}:{record['__line__']}"
            field = next((k for k in ("prompt", "input", "text") if k in record), None)
            if field is None or not isinstance(record[field], str):
                raise DataError(f"{where}: needs a string field 'prompt' (or 'input', 'text')")
            own = record.get("attributes")
            prompts.append((record[field], default if own is None else _attributes(own, f"{where}: attributes")))
    if not prompts:
        raise ConfigError("prompts (a list) or prompts_file (jsonl) must give at least one prompt")
    return prompts


def generation_service(model):
    """``compute(request) -> response`` of the text generation server (NeMo's ``/generate`` fields)."""
    from nemo_aligner.servers.text_generation_server import RequestError

    limit = int(model.cfg.encoder_seq_length)

    def compute(req: dict) -> dict:
        prompts = req["sentences"]
        for i, p in enumerate(prompts):
            n = len(model.tokenizer.text_to_ids(p))
            if n + req["tokens_to_generate"] > limit:
                raise RequestError(f"sentence {i} has {n} tokens; with tokens_to_generate={req['tokens_to_generate']} "
                                   f"it exceeds the model's sequence length {limit}")
        sentences = list(prompts)
        if req["tokens_to_generate"] > 0:
            sampling = SamplingParams(use_greedy=req["greedy"], temperature=req["temperature"], top_k=req["top_k"],
                                      top_p=req["top_p"] or 1.0, end_strings=req["end_strings"])  # NeMo: top_p 0 is off
            length = LengthParams(max_length=req["tokens_to_generate"], min_length=req["min_tokens_to_generate"])
            responses = generate_texts(model, prompts, sampling, length, seed=req["random_seed"],
                                       strip_end_strings=False)
            sentences = [p + r for p, r in zip(prompts, responses)]
        out = {"sentences": sentences}
        if req["compute_logprob"]:
            out["logprob"] = sentence_logprobs(model, sentences)
        return out
    return compute


def server_host(cfg: DictConfig) -> str:
    return str(cfg.get("host") or "127.0.0.1")


def server_port(cfg: DictConfig) -> int:
    port = cfg.get("port", 5555)
    if port is None:
        raise ConfigError("port=null: server=True needs a port")
    return int(port)


def serve(cfg: DictConfig, model, source: str) -> None:
    """``server=True``: answer ``PUT http://<host>:<port>/generate`` until SIGTERM/SIGINT."""
    import signal
    import threading

    from nemo_aligner.servers.text_generation_server import serve_text_generation

    stop = threading.Event()
    if is_global_rank_zero():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
    host, port = server_host(cfg), server_port(cfg)
    serve_text_generation(generation_service(model), host, port, int(model.cfg.encoder_seq_length), stop,
                          ready=lambda: print(f"serving {source} on http://{host}:{port}/generate",
                                              flush=True))


def refuse_eval_features(cfg: DictConfig) -> None:
    """``megatron_gpt_eval.py``'s chat web page is not here."""
    if cfg.get("chat"):
        raise ConfigError("chat=True: NeMo's chat web page is not available; server=True serves the REST API "
                          "(steerlm.attributes builds SteerLM chat prompts)")


def saved_model_config(directory: str):
    """The model config Lightning saved in a checkpoint NeMo wrote (``hyper_parameters.cfg`` in its
    common state), or None."""
    if not is_sharded_checkpoint(directory):
        return None
    common = load_common(directory)  # a checkpoint that cannot be read is an error naming it
    saved = (common.get("hyper_parameters") or {}).get("cfg") if isinstance(common, dict) else None
    return saved if isinstance(saved, (dict, DictConfig)) else None


class TrainingCheckpoint:
    """NeMo's other source for ``megatron_gpt_eval.py``: a training run's checkpoint directory
    (``checkpoint_dir``/``checkpoint_name``) with the run's ``hparams_file`` (default: the hparams.yaml
    of the log directory holding ``checkpoint_dir``, else the config a NeMo-written checkpoint holds).
    The architecture and tokenizer come from the .nemo the run started from (``restore_from_path`` in
    the run's config), or, for a run that started from scratch, from the run's model config; the
    weights from the checkpoint."""

    def __init__(self, cfg: DictConfig):
        directory, name = cfg.get("checkpoint_dir"), cfg.get("checkpoint_name")
        if not directory or not name:
            raise ConfigError(f"checkpoint_dir={directory} and checkpoint_name={name}: give both (a training "
                              "run's checkpoints directory and one checkpoint in it), or gpt_model_file")
        self.directory = checkpoint_dir_named(os.path.join(str(directory), str(name)))
        if not os.path.isdir(self.directory):
            raise ConfigError(f"checkpoint_dir/checkpoint_name={self.directory}: not a checkpoint directory (a "
                              "training run's checkpoints/<name>; NeMo's .ckpt files are not read)")
        hparams = cfg.get("hparams_file") or os.path.join(os.path.dirname(os.path.abspath(str(directory))),
                                                            "hparams.yaml")
        saved = None if cfg.get("hparams_file") or os.path.isfile(hparams) else saved_model_config(self.directory)
        if saved is not None:  # as NeMo's load_from_checkpoint: the config Lightning saved in the checkpoint
            run, hparams = OmegaConf.create({"cfg": saved}), os.path.join(self.directory, "common.pt")
        elif not os.path.isfile(hparams):
            raise ConfigError(f"hparams_file={cfg.get('hparams_file') or hparams}: no such file (the hparams.yaml a "
                              "training run writes in its log directory)")
        else:
            try:
                run = OmegaConf.load(hparams)
            except Exception as err:  # a YAML error names the line
                raise ConfigError(f"hparams_file={hparams}: not readable as YAML ({err})") from None
        model = run.get("model", run.get("cfg"))  # this project's run config; NeMo's hparams.yaml holds cfg:
        if not isinstance(model, DictConfig):
            raise ConfigError(f"hparams_file={hparams}: has no model section (model: or NeMo's cfg:)")
        peft = str((model.get("peft") or {}).get("peft_scheme") or "none").lower()
        if peft not in ("none", "null"):
            raise ConfigError(f"hparams_file={hparams}: a {peft} run's checkpoint is not read here (its adapters "
                              "would be left out); generate with gpt_model_file=<base .nemo> "
                              "model.peft.restore_from_path=<the run's adapters .nemo>")
        self.run_model = model
        paths = [(OmegaConf.select(run, key, default=None), key)
                 for key in ("pretrained_checkpoint.restore_from_path", "model.restore_from_path", "cfg.restore_from_path")]
        paths = [(str(path), key) for path, key in paths if path]
        self.base: Optional[str] = None
        if paths:
            self.base, key = paths[0]
            if not os.path.exists(self.base):
                raise ConfigError(f"hparams_file={hparams}: {key}={self.base}, the .nemo the run started from, does "
                                  "not exist; its architecture and tokenizer are needed with the checkpoint's weights")

    def prepare(self, cfg: DictConfig) -> Tuple[Optional[str], str]:
        """``(restore path, its key)`` for the run set-up; a run from scratch lends ``cfg.model`` its architecture."""
        if self.base is not None:
            return self.base, "the run's restore_from_path"
        keep = {k: cfg.model[k] for k in cfg.model if cfg.model.get(k) is not None}
        with open_dict(cfg):
            cfg.model = OmegaConf.merge(self.run_model, keep)
        return None, "hparams_file"

    def load(self, cfg: DictConfig):
        model = load_model(GPTSFTModel, cfg.model, cfg.trainer.precision, self.base, key="the run's restore_from_path",
                           trainable=False)
        model.load_weights(self.directory, what=f"checkpoint_dir/checkpoint_name={self.directory}")
        return model


def generation_source(cfg: DictConfig) -> Optional[TrainingCheckpoint]:
    """None for ``gpt_model_file``; a training checkpoint for ``checkpoint_dir``/``checkpoint_name``."""
    if cfg.get("gpt_model_file"):
        if cfg.get("checkpoint_dir") or cfg.get("checkpoint_name"):
            raise ConfigError(f"gpt_model_file={cfg.gpt_model_file} and checkpoint_dir={cfg.get('checkpoint_dir')}: "
                              "give one of them (a .nemo, or a training checkpoint with its hparams_file)")
        return None
    if not cfg.get("checkpoint_dir") and not cfg.get("checkpoint_name"):
        raise ConfigError("gpt_model_file is required: the .nemo to generate with (or checkpoint_dir, "
                          "checkpoint_name and hparams_file for a training checkpoint)")
    return TrainingCheckpoint(cfg)


def apply_eval_parallel_sizes(cfg: DictConfig) -> None:
    """NeMo's ``megatron_gpt_eval.py`` sets the parallel sizes at the top level
    (``tensor_model_parallel_size=8``); a value other than -1 there sets ``model.*``."""
    for key in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "expert_model_parallel_size"):
        value = cfg.get(key, -1)
        if value is None or value == -1:
            continue
        ours = OmegaConf.select(cfg, f"model.{key}")
        if ours not in (None, 1, value):
            raise ConfigError(f"{key}={value} and model.{key}={ours} disagree; set one of them")
        with open_dict(cfg):
            cfg.model[key] = value


def run_generate(cfg: DictConfig) -> List[dict]:
    """Load ``gpt_model_file`` at the configured TP/PP and answer every prompt (or, with ``server=True``,
    serve NeMo's text generation REST API)."""
    source = generation_source(cfg)
    refuse_eval_features(cfg)
    apply_eval_parallel_sizes(cfg)
    init_run(cfg, *((cfg.gpt_model_file, "gpt_model_file") if source is None else source.prepare(cfg)))

    def load():
        if source is not None:
            return source.load(cfg)
        return load_model(GPTSFTModel, cfg.model, cfg.trainer.precision, cfg.gpt_model_file, key="gpt_model_file",
                          trainable=False)

    if bool(cfg.get("server", False)):
        if is_global_rank_zero():  # before minutes of loading; rank 0 binds (a failure here ends every rank)
            check_bindable(server_host(cfg), {"port": server_port(cfg)})
        serve(cfg, load(), cfg.gpt_model_file if source is None else source.directory)
        return []
    prompts = read_prompts(cfg)
    for i, (prompt, _) in enumerate(prompts):
        if not prompt:
            raise DataError(f"prompt {i} is empty: a prompt needs at least one token")
    inf = cfg.inference

    # the models' sampling_params rules (null reads as the default; 0 is a setting), under this
    # script's key for greedy decoding
    sampling = SamplingParams.from_cfg({**OmegaConf.to_container(inf, resolve=True), "use_greedy": bool(inf.greedy)})
    sampling.end_strings = [unescape(s) for s in sampling.end_strings]
    if not 0.0 < sampling.top_p <= 1.0:
        raise ConfigError(f"inference.top_p={inf.top_p} must be in (0, 1] (1.0: off)")
    output_file = cfg.get("output_file")
    if output_file and os.path.isdir(str(output_file)):
        raise ConfigError(f"output_file={output_file} is a directory; give the jsonl file's path")
    model = load()
    system = str((cfg.get("steerlm") or {}).get("system") or "")
    chat_tokens = model_chat_tokens(model.cfg)
    prompts_in = [p if attrs is None else steer_prompt(p, attrs, system=system, chat_tokens=chat_tokens)
                  for p, attrs in prompts]
    length = LengthParams(max_length=int(inf.tokens_to_generate), min_length=int(inf.min_tokens_to_generate))
    responses = generate_texts(model, prompts_in, sampling, length, seed=inf.get("seed"),
                               batch_size=int(cfg.get("batch_size", 16)), data_parallel=True)
    results = []
    for (prompt, attrs), response in zip(prompts, responses):
        row = {"prompt": prompt, "response": response}
        if attrs is not None:
            row["attributes"] = attrs
        results.append(row)
    if is_global_rank_zero():
        if cfg.get("output_file"):
            write_jsonl(cfg.output_file, results)
            print(f"{len(results)} responses written to {cfg.output_file}", flush=True)
        else:
            for row in results:
                print(json.dumps(row), flush=True)
    return results
