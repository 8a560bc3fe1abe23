"""The TrainingJob controller hands the operator's images to the pods it renders: LOOM_TRAINER_IMAGE to the
workers, LOOM_FEATURES_IMAGE to the training-data Job (the chart sets both from image.registry; Loom publishes no
default). The other kinds are checked in their controllers' tests (`*_image_the_operator_was_given`)."""

from __future__ import annotations

from typing import Any

import kopf
import pytest

from loom.e2e.stack_images import DISTINCT_IMAGE_SETTINGS, pod_images
from loom.operator.kinds.featureview.api import FeatureViewSpec
from loom.operator.kinds.featureview.config import Member, plan_project
from loom.operator.kinds.trainingjob import controller as trainingjob
from loom.operator.kinds.trainingjob import render
from loom.operator.kinds.trainingjob.api import TrainingJobSpec
from loom.operator.kinds.trainingjob.data.retrieval import render_data_job
from loom.operator.settings import OperatorSettings

JOB: dict[str, Any] = {
    "apiVersion": "loom.dev/v1alpha1",
    "kind": "TrainingJob",
    "metadata": {"name": "gpt", "namespace": "team-a", "uid": "uid-123", "generation": 1},
}
SPEC = TrainingJobSpec.model_validate(
    {
        "engine": "fsdp",
        "entrypoint": {"module": "loom.workloads.trainer.examples.chargpt:task"},
        "workers": {"replicas": 2},
        "checkpoint": {"uri": "s3://ckpt/gpt", "secretRef": {"name": "keys"}},
        "trainingData": {"featureView": "stats", "entityDataframe": "s3://b/entities.parquet"},
    }
)


def registered_controller(settings: OperatorSettings, monkeypatch: pytest.MonkeyPatch) -> trainingjob.Controller:
    """The Controller that `register` builds from the settings (registered into a throwaway Kopf registry)."""
    built: list[trainingjob.Controller] = []
    real = trainingjob.Controller

    def recorded(*args: Any, **kwargs: Any) -> trainingjob.Controller:
        built.append(real(*args, **kwargs))
        return built[-1]

    monkeypatch.setattr(trainingjob, "Controller", recorded)
    previous = kopf.get_default_registry()
    kopf.set_default_registry(kopf.OperatorRegistry())
    try:
        trainingjob.register(settings)
    finally:
        kopf.set_default_registry(previous)
    [controller] = built
    return controller


def test_workers_and_the_training_data_job_run_the_images_the_operator_was_given(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    settings = OperatorSettings(**DISTINCT_IMAGE_SETTINGS)
    controller = registered_controller(settings, monkeypatch)
    assert (controller.image, controller.features_image) == (settings.trainer_image, settings.features_image)
    worker = render.worker_pod(JOB, SPEC, 0, attempt=0, image=controller.image, mlflow_run_id=None)
    assert pod_images(worker) == {DISTINCT_IMAGE_SETTINGS["trainer_image"]}
    view = FeatureViewSpec.model_validate(
        {
            "project": "rides",
            "entities": [{"name": "driver_id"}],
            "features": [{"name": "trips", "dtype": "Float32"}],
            "source": {"path": "/data/x.parquet"},
        }
    )
    plan = plan_project("rides", [Member("stats", "fv-uid", "2026-01-01T00:00:00Z", view)])
    data_job = render_data_job(JOB, SPEC, plan, controller.features_image)
    assert pod_images(data_job) == {DISTINCT_IMAGE_SETTINGS["features_image"]}
    # A job's own spec.image still wins for its workers (the operator's image is the default).
    own = SPEC.model_copy(update={"image": "registry.example.com/team/trainer:7"})
    assert pod_images(render.worker_pod(JOB, own, 0, attempt=0, image=controller.image, mlflow_run_id=None)) == {
        "registry.example.com/team/trainer:7"
    }
