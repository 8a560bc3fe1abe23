"""spec.trainingData: a point-in-time training set from a FeatureView, built by one Job before the workers start:
api.py (its fields), retrieval.py (the Job, the workers' env, its outcome; pure), state.py (the state machine waits
for it), io.py (the FeatureView and Job reads, the Job's creation)."""
