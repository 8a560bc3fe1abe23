# Feast image (LOOM_FEATURES_IMAGE, the chart's workloadImages.features): the FeatureView apply/materialize Jobs,
# the feature server, a TrainingJob's training-data retrieval. No torch. BASE: see operator.Dockerfile.
ARG BASE=python:3.11-slim
FROM ${BASE} AS build
# The folder operator/ in /src would shadow the stdlib module `operator` for any python started there.
ENV PYTHONSAFEPATH=1
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY operator operator
COPY workloads workloads
# boto3 beside the extra: Feast's s3:// registry and Loom's S3 file source (workloads/features) use it.
RUN python3 -m venv /opt/loom && /opt/loom/bin/pip install --no-cache-dir --disable-pip-version-check \
      '.[features]' 'boto3>=1.34,<2' \
 && /opt/loom/bin/pip uninstall -y -q pip

FROM ${BASE}
RUN useradd --uid 1000 --create-home loom
COPY --from=build /opt/loom /opt/loom
USER 1000
ENV PATH=/opt/loom/bin:$PATH PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1
EXPOSE 6566 8000
ENTRYPOINT ["python", "-m", "loom.workloads.features"]
