"""A PyTriton ``reward_model`` whose first ``--slow-calls`` requests take ``--delay`` seconds (then it
answers at once with the row sums of ``tokens``): a server that is merely slow, for client retry tests."""

import argparse
import threading
import time

import numpy as np

from nemo_aligner.servers.request_guard import ModelLimits
from nemo_aligner.servers.triton_host import ServerAddress, serve_forever


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--grpc-port", type=int, required=True)
    parser.add_argument("--metrics-port", type=int, required=True)
    parser.add_argument("--workspace", required=True)
    parser.add_argument("--delay", type=float, default=5.0)
    parser.add_argument("--slow-calls", type=int, default=1)
    args = parser.parse_args()
    calls = {"n": 0}
    lock = threading.Lock()

    def infer(**inputs):
        with lock:
            calls["n"] += 1
            n = calls["n"]
        if n <= args.slow_calls:
            time.sleep(args.delay)
        print(f"answered call {n}", flush=True)
        return {"rewards": inputs["tokens"].sum(axis=1, keepdims=True).astype(np.float32)}

    def bind(triton):
        from pytriton.decorators import batch
        from pytriton.model_config import ModelConfig, Tensor

        triton.bind(model_name="reward_model", infer_func=batch(infer),
                    inputs=[Tensor(name="tokens", dtype=np.int64, shape=(-1,)),
                            Tensor(name="sequence_lengths", dtype=np.int64, shape=(1,))],
                    outputs=[Tensor(name="rewards", dtype=np.float32, shape=(1,))],
                    config=ModelConfig(max_batch_size=8), strict=True)

    serve_forever(ServerAddress("127.0.0.1", args.port, args.grpc_port, args.metrics_port), bind, "slow server",
                  "slow", {"reward_model": ModelLimits(8, 64)}, args.workspace)


if __name__ == "__main__":
    main()
