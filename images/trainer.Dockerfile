# Trainer image: torch + deepspeed + the trainer workload. Models and data never live in the image.
ARG BASE=python:3.11-slim
FROM ${BASE} AS build
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY operator operator
COPY workloads workloads
RUN pip install --no-cache-dir 'torch>=2.5,<3' && pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM ${BASE}
RUN useradd --uid 1000 --create-home loom
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir 'torch>=2.5,<3' \
 && pip install --no-cache-dir --no-build-isolation "$(ls /wheels/*.whl)[train]" && rm -rf /wheels
USER 1000
ENV PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1
ENTRYPOINT ["torchrun"]
