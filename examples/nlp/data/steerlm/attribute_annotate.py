"""Label NeMo chat data with SteerLM attributes from a running regression reward-model server.

    python examples/nlp/gpt/serve_reward_model.py rm_model_file=rm.nemo inference.port=5555 &
    python examples/nlp/data/steerlm/attribute_annotate.py --input-file chat.jsonl \
        --output-file chat_labelled.jsonl --port 5555 --attributes quality,verbosity
"""

from nemo_aligner.recipes.attribute_annotate import main
from nemo_aligner.utils.hydra_runner import run_cli

if __name__ == "__main__":
    run_cli(main)
