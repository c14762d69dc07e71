# nemo-aligner on a NeMo or PyTorch container: the container's own torch (and megatron-core, where
# it has one) is kept; pip adds only what is missing.
#   docker build -t nemo-aligner .                                            # PyTorch container
#   docker build --build-arg BASE_IMAGE=nvcr.io/nvidia/nemo:25.09 -t nemo-aligner:nemo .
#   docker build --build-arg INSTALL_TE=1 -t nemo-aligner:te .                # adds Transformer Engine
ARG BASE_IMAGE=nvcr.io/nvidia/pytorch:25.10-py3
FROM ${BASE_IMAGE}

ARG INSTALL_TE=0
ENV PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1

WORKDIR /opt/nemo-aligner
COPY . .
# The torch the image came with, checked again after the install: pip must not have replaced it.
RUN python -c "import torch; print(torch.__version__)" > /tmp/torch_before && \
    pip install . && \
    if [ "$INSTALL_TE" = "1" ]; then pip install --no-build-isolation ".[gpu]"; fi && \
    python -c "import torch; print(torch.__version__)" | cmp - /tmp/torch_before && \
    python -c "import nemo_aligner, megatron.core; print('nemo-aligner', nemo_aligner.__version__)"

CMD ["bash"]
