# syntax=docker/dockerfile:1
# Engine image for the Helm chart's launchPair mode: SGLang's image plus specrouter, so one
# container can run `specrouter launch-pair` (both servers of a pair on the pod's one GPU).
#   docker build -f deploy/docker/engine.Dockerfile -t specrouter-engine:0.1.0 .
ARG SGLANG_IMAGE=lmsysorg/sglang:latest

FROM python:3.11-slim AS build
WORKDIR /src
RUN pip install --no-cache-dir build
COPY pyproject.toml README.md ./
COPY specrouter ./specrouter
RUN python -m build --wheel --outdir /wheels .

FROM ${SGLANG_IMAGE}
# SGLang (the `engine` extra) is already in the base image: install specrouter on top of it
# without letting pip touch SGLang's pinned torch/CUDA stack.
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    pip install --no-cache-dir /wheels/specrouter-*.whl
ENTRYPOINT ["specrouter", "launch-pair"]
