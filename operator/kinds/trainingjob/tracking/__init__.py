"""spec.tracking.mlflow: the job's MLflow run, created before the workers start (every retry logs into it) and
closed when the job finished: api.py (its fields), io.py (MLflow's REST API). The trainer's side of the run is
rendered with the rest of its config (config.py)."""
