# InferenceService runtime vllm: the vLLM engine and Loom's workloads in one environment, so that the pod's fetch step
# (python -m loom.workloads.server.fetch) and its server container (Loom's OpenAI-compatible front,
# python -m loom.workloads.llm, which starts the engine as `python -m vllm.entrypoints.openai.api_server`) both run
# from it. vLLM brings its own torch (its CUDA build); Loom's [serve] and [llm] extras go beside it, without torch.
# The model is fetched at boot into a cache volume, never baked in. BASE: see operator.Dockerfile.
# The local stack runs no image: its node agent runs this image's containers from the checkout's .venv-vllm
# (`make venv-vllm`, vLLM's CPU build), devstack/cluster/paths.py.
ARG BASE=python:3.11-slim
ARG VLLM=vllm==0.32.0
FROM ${BASE} AS build
ARG VLLM
# The folder operator/ in /src would shadow the stdlib module `operator` for any python started there.
ENV PYTHONSAFEPATH=1
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY operator operator
COPY workloads workloads
RUN python3 -m venv /opt/loom && /opt/loom/bin/pip install --no-cache-dir --disable-pip-version-check \
      "${VLLM}" '.[serve,llm]' \
 && /opt/loom/bin/pip uninstall -y -q pip

FROM ${BASE}
RUN useradd --uid 1000 --create-home loom
COPY --from=build /opt/loom /opt/loom
USER 1000
ENV PATH=/opt/loom/bin:$PATH PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1
EXPOSE 8080
ENTRYPOINT ["python", "-m", "loom.workloads.llm"]
