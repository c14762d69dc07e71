"""Job set-up, one module per script stem: build the model, data, servers and trainer, then run.

The Hydra scripts in ``examples/nlp/gpt/`` and the Python API call these; trainer loops live in
:mod:`nemo_aligner.algorithms`."""
