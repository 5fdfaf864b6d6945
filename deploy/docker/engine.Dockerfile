# syntax=docker/dockerfile:1
# Engine image: SGLang's image plus specrouter, so one container runs `specrouter launch-pair`
# (both servers of a pair on its one GPU, started in order and stopped as one unit).
#   docker build -f deploy/docker/engine.Dockerfile -t specrouter-engine:0.1.0 .
# The SGLang image is pinned: the planner follows this version's memory rule and flag names
# (`specrouter plan --sglang-version`). Pin a digest (lmsysorg/sglang:v0.5.23@sha256:...)
# for reproducible builds; pass --build-arg SGLANG_IMAGE=... to change it, together with
# engines.sglangVersion (chart) or SGLANG_VERSION (compose) when the minor version changes.
ARG SGLANG_IMAGE=lmsysorg/sglang:v0.5.23

FROM python:3.11-slim AS build
WORKDIR /src
RUN pip install --no-cache-dir build
COPY pyproject.toml README.md ./
COPY specrouter ./specrouter
RUN python -m build --wheel --outdir /wheels .

FROM ${SGLANG_IMAGE}
# specrouter goes on top of SGLang without moving any package SGLang was built and tested
# with: every installed distribution is frozen at its version as a constraint, so pip fails
# the build rather than upgrade torch, CUDA wheels or SGLang's own pins; `pip check` then
# fails it if anything installed is inconsistent.
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    python3 -m pip list --format=freeze > /tmp/sglang-frozen.txt \
    && python3 -m pip install --no-cache-dir --constraint /tmp/sglang-frozen.txt \
       /wheels/specrouter-*.whl \
    && python3 -m pip check \
    && rm /tmp/sglang-frozen.txt
ENTRYPOINT ["specrouter", "launch-pair"]
