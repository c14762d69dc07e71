"""Pack an SFT jsonl into ``.npy`` files of packed sequences (NeMo's ``prepare_packed_ft_dataset.py``
command line and output format):

    python examples/nlp/data/sft/prepare_packed_ft_dataset.py \
        model.data.train_ds.file_names=[train.jsonl] model.data.train_ds.max_seq_length=2048 \
        +tokenizer_path=model.nemo +output_dir=packed +pack_sizes=[4096,8192]

Writes ``<output_dir>/packed_{pack_size}_seed{seed}.npy``; train with
``model.data.train_ds.packed_sequence=True model.data.train_ds.file_path=<that file>`` (docs/sft.md).
The tokenizer is ``+tokenizer_path``'s (a .nemo, a SentencePiece model or a Hugging Face directory),
else ``model.restore_from_path``'s, else ``model.tokenizer``. ``+packing_algorithm``:
first_fit_shuffle (default) or first_fit_decreasing; ``+seed`` (0) orders the shuffle.
"""

from nemo_aligner.recipes.prepare_packed import PACKING_KEYS, run_prepare_packed_sft
from nemo_aligner.utils.hydra_runner import hydra_runner


@hydra_runner(config_path="../../gpt/conf", config_name="gpt_sft", extra_keys=PACKING_KEYS)
def main(cfg):
    return run_prepare_packed_sft(cfg)


if __name__ == "__main__":
    main()
