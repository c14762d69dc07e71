# GPU image: CUDA base, Python 3.11, torch 2.13.0 (CUDA build from PyPI), nemo-aligner.
#   docker build -t nemo-aligner .
#   docker build --build-arg INSTALL_TE=1 -t nemo-aligner:te .   # adds Transformer Engine (long build)
FROM nvidia/cuda:12.8.1-cudnn-devel-ubuntu22.04

ARG INSTALL_TE=0
ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1

RUN apt-get update && apt-get install -y --no-install-recommends \
        python3.11 python3.11-venv python3.11-dev git build-essential && \
    rm -rf /var/lib/apt/lists/* && \
    python3.11 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH

WORKDIR /opt/nemo-aligner
COPY . .
RUN pip install --upgrade pip && \
    pip install torch==2.13.0 && \
    pip install . && \
    if [ "$INSTALL_TE" = "1" ]; then pip install --no-build-isolation ".[gpu]"; fi

CMD ["bash"]
