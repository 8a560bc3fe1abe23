# Trainer image: torch + deepspeed + the trainer workload. Models and data never live in the image.
# BASE: see operator.Dockerfile.
ARG BASE=python:3.11-slim
FROM ${BASE} AS build
# The folder operator/ in /src would shadow the stdlib module `operator` for any python started there.
ENV PYTHONSAFEPATH=1
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY operator operator
COPY workloads workloads
# torch first: deepspeed's source distribution imports it while it builds (hence no build isolation for it).
# DS_BUILD_OPS=0: no CUDA/C++ op is compiled here (no nvcc in the image); DeepSpeed's ops are JIT-built on first use.
# deepspeed's setup.py imports its own op_builder/ from the folder it runs in, which PYTHONSAFEPATH hides, so that
# install runs without it (pip runs as a script, so /src/operator still cannot shadow the stdlib).
RUN python3 -m venv /opt/loom && /opt/loom/bin/pip install --no-cache-dir --disable-pip-version-check \
      'torch>=2.5,<3' setuptools wheel \
 && env -u PYTHONSAFEPATH DS_BUILD_OPS=0 \
      /opt/loom/bin/pip install --no-cache-dir --disable-pip-version-check --no-build-isolation '.[train]' \
 && /opt/loom/bin/pip uninstall -y -q pip

FROM ${BASE}
RUN useradd --uid 1000 --create-home loom
COPY --from=build /opt/loom /opt/loom
USER 1000
ENV PATH=/opt/loom/bin:$PATH PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1
ENTRYPOINT ["torchrun"]
