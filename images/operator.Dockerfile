# The operator image: the light install only (no torch, deepspeed, feast or mlflow).
FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY operator operator
COPY workloads workloads
RUN pip wheel --no-cache-dir --wheel-dir /wheels .

FROM python:3.11-slim
RUN useradd --uid 1000 --create-home loom
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir /wheels/*.whl && rm -rf /wheels
USER 1000
ENV PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1
EXPOSE 8080 8081
ENTRYPOINT ["loom", "operator"]
