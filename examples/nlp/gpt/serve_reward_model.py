"""Serve a reward model (NeMo-Aligner's serve_reward_model.py command line).

    python examples/nlp/gpt/serve_reward_model.py rm_model_file=rm.nemo inference.port=5555
    torchrun --nproc_per_node 2 examples/nlp/gpt/serve_reward_model.py rm_model_file=rm.nemo \
        trainer.devices=2 model.tensor_model_parallel_size=2
"""

from nemo_aligner.recipes.serve_reward_model import serve_reward_model
from nemo_aligner.utils.hydra_runner import hydra_runner


@hydra_runner(config_path="conf", config_name="inference_rm")
def main(cfg):
    serve_reward_model(cfg)


if __name__ == "__main__":
    main()
