"""Pack a DPO jsonl into ``.npy`` files of packed chosen/rejected pairs (NeMo-Aligner's
``prepare_packed_dpo_dataset.py`` command line and output format):

    python examples/nlp/data/dpo/prepare_packed_dpo_dataset.py \
        model.data.data_prefix=train.jsonl model.encoder_seq_length=1024 \
        +tokenizer_path=model.nemo +output_dir=packed +pack_sizes=[2048,4096]

Each pair's chosen and rejected responses stay in one pack, so a pack size should be at least twice
the sequence length. Writes ``<output_dir>/packed_{pack_size}_seed{seed}.npy``; train with
``++model.data.data_impl=packed_jsonl`` and those files in ``model.data.data_prefix`` (docs/dpo.md).
"""

from nemo_aligner.recipes.prepare_packed import PACKING_KEYS, run_prepare_packed_dpo
from nemo_aligner.utils.hydra_runner import hydra_runner


@hydra_runner(config_path="../../gpt/conf", config_name="gpt_dpo", extra_keys=PACKING_KEYS)
def main(cfg):
    return run_prepare_packed_dpo(cfg)


if __name__ == "__main__":
    main()
