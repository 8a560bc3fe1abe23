"""spec.register: a succeeded job's export registered as one new MLflow model version, optionally under an alias:
api.py (its fields), version.py (when, and the version's tags; pure), io.py (the registry's writes)."""
