# Model server and graph router image. The model is fetched at boot into a cache volume, never baked in.
# BASE: see operator.Dockerfile.
ARG BASE=python:3.11-slim
FROM ${BASE} AS build
# The folder operator/ in /src would shadow the stdlib module `operator` for any python started there.
ENV PYTHONSAFEPATH=1
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY operator operator
COPY workloads workloads
# torch from its CPU-or-CUDA default index; the [serve] extra beside it, in one virtual environment.
RUN python3 -m venv /opt/loom && /opt/loom/bin/pip install --no-cache-dir --disable-pip-version-check \
      '.[serve]' 'torch>=2.5,<3' \
 && /opt/loom/bin/pip uninstall -y -q pip

FROM ${BASE}
RUN useradd --uid 1000 --create-home loom
COPY --from=build /opt/loom /opt/loom
USER 1000
ENV PATH=/opt/loom/bin:$PATH PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1
EXPOSE 8080
ENTRYPOINT ["python", "-m", "loom.workloads.server"]
