"""Transformer Engine's layer spec against megatron-core's local spec, where Transformer Engine is
installed on a GPU (``pip install .[gpu]``): the same weights give the same logits within bf16
tolerance, and a .nemo written by either spec loads into the other. Elsewhere every test here is
skipped, with the reason (``pytest -rs`` prints it). To check a Transformer Engine machine:
``python -m pytest -rs tests/test_te_spec.py``."""

import pytest
import torch
from omegaconf import OmegaConf

from conftest import TINY_ARCH, TINY_GPT2_ARCH, forward_logits
from nemo_aligner.models.nlp.gpt.gpt_builder import te_available, uses_te_spec


def _skip_reason() -> str:
    if not torch.cuda.is_available():
        return "Transformer Engine's layer spec needs a GPU: none is visible"
    return "Transformer Engine's layer spec: transformer_engine does not import here (pip install .[gpu])"


pytestmark = pytest.mark.skipif(not te_available(), reason=_skip_reason())

# "window": NeMo's sliding window (Mistral), computed by Transformer Engine on one side and by the
# local spec's SDPA attention on the other; 24 tokens against a window of 8
# "moe": Mixtral-shaped routed experts (TE's spec keeps the pre-MLP norm apart from the experts)
ARCHS = {"llama": TINY_ARCH, "gpt2": TINY_GPT2_ARCH, "window": dict(TINY_ARCH, window_size=[7, 0]),
         "moe": dict(TINY_ARCH, num_moe_experts=4, moe_router_topk=2)}


def _model(arch, local: bool, seed: int = 0):
    from nemo_aligner.models.nlp.gpt.gpt_sft_model import GPTSFTModel
    from nemo_aligner.utils.tokenizers import ByteTokenizer

    torch.manual_seed(seed)
    torch.cuda.manual_seed(seed)
    cfg = OmegaConf.create(dict(ARCHS[arch], micro_batch_size=2, encoder_seq_length=32, force_local_spec=local))
    return GPTSFTModel(cfg, ByteTokenizer(), "bf16", trainable=False)


@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("writer", ["te", "local"])
def test_logits_agree_and_checkpoints_interchange(tmp_path, mcore_single, arch, writer):
    from nemo_aligner.models.nlp.gpt.gpt_sft_model import GPTSFTModel
    from nemo_aligner.models.nlp.gpt.loading import load_model
    from nemo_aligner.utils.nemo_file import read_model_config, save_nemo

    written = _model(arch, local=writer == "local")
    assert uses_te_spec(written.cfg) == (writer == "te")
    nemo = save_nemo(written, str(tmp_path / f"{writer}.nemo"))
    assert read_model_config(nemo, "model.restore_from_path")["transformer_engine"] == (writer == "te")
    tokens = torch.randint(0, 259, (2, 24), generator=torch.Generator().manual_seed(1))
    expected = forward_logits(written, tokens).float()
    for local in (True, False):
        read = load_model(GPTSFTModel, OmegaConf.create({"micro_batch_size": 2, "force_local_spec": local}), "bf16",
                          nemo)
        assert uses_te_spec(read.cfg) == (not local)
        got = forward_logits(read, tokens).float()
        # bf16 activations: a few units in the last place of the logits' scale
        scale = expected.abs().max().item()
        torch.testing.assert_close(got, expected, rtol=0, atol=0.03 * scale, msg=lambda m: f"read by "
                                   f"{'local' if local else 'TE'} spec: {m}")
