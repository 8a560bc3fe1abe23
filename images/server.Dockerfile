# Model server and graph router image. The model is fetched at boot into a cache volume, never baked in.
ARG BASE=python:3.11-slim
FROM ${BASE} AS build
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY operator operator
COPY workloads workloads
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM ${BASE}
RUN useradd --uid 1000 --create-home loom
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir "$(ls /wheels/*.whl)[serve]" 'torch>=2.5,<3' && rm -rf /wheels
USER 1000
ENV PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1
EXPOSE 8080
ENTRYPOINT ["python", "-m", "loom.workloads.server"]
