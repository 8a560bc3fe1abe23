# The operator image: the light install only (no torch, deepspeed, feast or mlflow).
# BASE: any image with python3 (3.11+), its venv module and useradd. `make images` builds FROM a base made
# from Debian's packages on this machine (images/build.sh); elsewhere the default comes from a registry.
ARG BASE=python:3.11-slim
FROM ${BASE} AS build
# The folder operator/ in /src would shadow the stdlib module `operator` for any python started there.
ENV PYTHONSAFEPATH=1
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY operator operator
COPY workloads workloads
# A virtual environment: the same layout on python-slim and on Debian's python3 (whose system site is
# externally managed, PEP 668); the final stage copies it whole, so no wheel or pip cache reaches it.
RUN python3 -m venv /opt/loom && /opt/loom/bin/pip install --no-cache-dir --disable-pip-version-check . \
 && /opt/loom/bin/pip uninstall -y -q pip

FROM ${BASE}
RUN useradd --uid 1000 --create-home loom
COPY --from=build /opt/loom /opt/loom
USER 1000
ENV PATH=/opt/loom/bin:$PATH PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1
EXPOSE 8080 8081 9443
ENTRYPOINT ["loom", "operator"]
