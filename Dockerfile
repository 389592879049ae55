# The image cluster launches run (launch.image): shardline and its CUDA PyTorch in /opt/venv, as user 1000.
# Two stages: the CUDA devel image installs (and compiles flash-attn when asked), the runtime image receives the
# finished virtual environment only. No version is written here: scripts/install-python, the lines
# scripts/setup runs too, installs torch at scripts/torch-version and the rest within pyproject.toml's ranges.
#   docker build --build-arg GIT_COMMIT="$(git rev-parse HEAD)" -t REGISTRY/shardline:TAG .
#   --build-arg FLASH_ATTN=true   adds flash-attn (model.attn_implementation: flash_attention_2)
# Base images: NVIDIA's CUDA 12.8.1 + cuDNN on Ubuntu 24.04, pinned by the digest of each tag's multi-arch index
# (refresh both with `docker buildx imagetools inspect nvidia/cuda:<tag>`); 12.8 matches TORCH_INDEX (cu128).

FROM nvidia/cuda:12.8.1-cudnn-devel-ubuntu24.04@sha256:24c8e3581ea6330038b0d374920721983312627f8adbfcf390bdb4b399d280ed AS build
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu128
ARG EXTRAS=gpu,cloud,hub,observe,ray,kubeflow
ARG FLASH_ATTN=false
# flash-attn compiles with this many jobs where no prebuilt wheel matches (each takes several GB of memory).
ARG MAX_JOBS=8
ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1
# Ubuntu's archive drops superseded package versions, so exact apt pins would break rebuilds; the base digest
# fixes the release (noble, Python 3.12).
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python3-dev \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml README.md LICENSE ./
COPY scripts/ scripts/
COPY src/ src/
RUN if [ "$FLASH_ATTN" = true ]; then EXTRAS="$EXTRAS,flash"; fi \
 && TORCH_INDEX="$TORCH_INDEX" MAX_JOBS="$MAX_JOBS" scripts/install-python /opt/venv "$EXTRAS"

FROM nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04@sha256:ac55d124da4882b497f732d8dfd9a702d5447a5f29d08d56da6f64f0a1eb34bc AS runtime
# The uid and gid pods run as (engines/kubernetes/pod.py USER_ID); Ubuntu's own user 1000 makes way.
ARG USER_ID=1000
# The source commit, recorded in every run's manifest.json (git_commit) since the image holds no .git.
ARG GIT_COMMIT=""
# wget: KubeRay's default health probes run it in the Ray containers of a RayJob (--target rayjob).
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 wget \
 && rm -rf /var/lib/apt/lists/* \
 && if id ubuntu >/dev/null 2>&1; then userdel --remove ubuntu; fi \
 && groupadd --gid "$USER_ID" shardline \
 && useradd --create-home --uid "$USER_ID" --gid "$USER_ID" --shell /bin/bash shardline
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 SHARDLINE_GIT_COMMIT=$GIT_COMMIT
LABEL org.opencontainers.image.title=shardline org.opencontainers.image.revision=$GIT_COMMIT
USER $USER_ID:$USER_ID
WORKDIR /home/shardline
CMD ["shardline", "--help"]
