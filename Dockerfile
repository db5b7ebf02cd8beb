# padim on an NVIDIA GPU node. The torch wheels carry CUDA 13.0 (torch 2.14.1+cu130) and bring
# their own CUDA libraries (cuBLAS, cuDNN, NCCL, ...), so the base is NVIDIA's *base* CUDA 13.0
# image (the driver hooks and a CUDA version check, no second copy of the libraries that the
# -runtime- tag would add); tests/docker checks that the two versions agree. The host needs an
# NVIDIA driver >= 580 (CUDA 13.0) and a GPU of compute capability 7.5 or newer (T4, A10, L4, A100,
# H100, ...; not V100/P100), and the NVIDIA Container Toolkit for --gpus. See docs/gpu.md.
#
#   docker build -t padim --build-arg BAKE_WEIGHTS="resnet18 wide_resnet50_2" .
#   docker run --gpus all -p 8000:8000 -v $PWD/models:/models:ro padim            # serve /models/*.padim
#   (without a GPU it scores with onnxruntime; the export it makes of each .padim is cached in ~/.cache/padim;
#    with one, .padim files run on torch + CUDA and export directories on onnxruntime's CPU provider)
#   docker stop -t 40 <container>                                                 # drains (PADIM_DRAIN_TIMEOUT_S=30)
#   docker run --gpus all -v $PWD/data:/data:ro -v $PWD/models:/models padim train /data --output /models/line3.padim
#
# Behind a TLS-inspecting proxy: put its CA certificate(s) in docker/extra-ca/*.crt, and give a
# package index with --build-arg PACKAGE_INDEX=https://pypi.example.corp/simple (and/or
# EXTRA_PACKAGE_INDEX). Both are used by the build stage only; see docs/deployment.md.
# Plain `docker build` and BuildKit both build this file (no `# syntax=` line: that would make
# BuildKit fetch a frontend image from a registry).
ARG CUDA_IMAGE=nvidia/cuda:13.0.0-base-ubuntu24.04

# The dependencies, before any source: this ~6 GB layer (most of the build's time) is reused by a rebuild after a
# change to the code, as long as pyproject.toml and constraints.txt are unchanged.
FROM ${CUDA_IMAGE} AS deps
LABEL padim.stage=deps
ARG DEBIAN_FRONTEND=noninteractive
ARG PACKAGE_INDEX=""
ARG EXTRA_PACKAGE_INDEX=""
COPY docker/extra-ca/ /usr/local/share/ca-certificates/extra/
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates python3 python3-venv \
    && update-ca-certificates \
    && rm -rf /var/lib/apt/lists/*
# pip trusts the system bundle, extra CAs included (its own certifi bundle would not have them)
ENV VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH TORCH_HOME=/opt/torch \
    PIP_CERT=/etc/ssl/certs/ca-certificates.crt PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python3 -m venv /opt/venv
WORKDIR /src
COPY constraints.txt pyproject.toml ./
COPY docker/requirements.py ./docker/
RUN python3 docker/requirements.py onnxruntime,postgres,lines,camera,opcua > requirements.txt \
    && pip install ${PACKAGE_INDEX:+--index-url "$PACKAGE_INDEX"} ${EXTRA_PACKAGE_INDEX:+--extra-index-url "$EXTRA_PACKAGE_INDEX"} \
        -c constraints.txt -r requirements.txt \
    && pip uninstall -y triton

# The package itself, as a wheel (not an editable install), and the weights to bake in.
FROM deps AS build
# marks this stage's image, so that it can be removed once the final image exists:
# docker image prune --filter label=padim.stage=build (the final stage does not inherit it)
LABEL padim.stage=build
# Backbones whose ImageNet weights are baked into the image (empty: none), so that a node
# without internet can train with --weights imagenet. Needs download.pytorch.org at build time.
ARG BAKE_WEIGHTS="resnet18"
ARG PACKAGE_INDEX=""
ARG EXTRA_PACKAGE_INDEX=""
COPY setup.py README.md ./
COPY cli ./cli
COPY core ./core
COPY models ./models
COPY service ./service
COPY configs ./configs
RUN pip wheel ${PACKAGE_INDEX:+--index-url "$PACKAGE_INDEX"} ${EXTRA_PACKAGE_INDEX:+--extra-index-url "$EXTRA_PACKAGE_INDEX"} \
        --no-deps --wheel-dir /wheels . \
    && pip install --no-deps --no-index /wheels/*.whl \
    && mkdir -p /opt/torch \
    && if [ -n "$BAKE_WEIGHTS" ]; then padim fetch-weights $BAKE_WEIGHTS; fi

FROM ${CUDA_IMAGE}
ARG DEBIAN_FRONTEND=noninteractive
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --create-home --uid 10001 --shell /usr/sbin/nologin padim \
    && mkdir -p /models /record \
    && chown padim:padim /models /record
# the dependencies' environment (a cached layer while they are unchanged), then the package's wheel into it
COPY --from=deps /opt/venv /opt/venv
COPY --from=build /wheels /tmp/wheels
RUN /opt/venv/bin/pip install --no-deps --no-index --no-cache-dir --disable-pip-version-check /tmp/wheels/*.whl \
    && rm -rf /tmp/wheels
COPY --from=build /opt/torch /opt/torch
ENV VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH TORCH_HOME=/opt/torch \
    PADIM_HOST=0.0.0.0 PADIM_PORT=8000 PYTHONUNBUFFERED=1
USER 10001:10001
WORKDIR /home/padim
EXPOSE 8000
STOPSIGNAL SIGTERM
HEALTHCHECK --interval=15s --timeout=5s --start-period=60s --retries=3 CMD ["padim", "health"]
ENTRYPOINT ["padim"]
# the models in /models; `serve --repository /models/repo` (mounted read-write) serves a versioned repository instead
CMD ["serve", "--model-dir", "/models"]
