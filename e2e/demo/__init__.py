"""`make demo`: every part of Loom, in order, on the local real stack (`python -m loom.e2e.demo`).

One module per part, each a function `run(demo) -> Outcome` (one line, one key figure):

  install    the stack, what the examples need (S3, MLflow, Redis, Prometheus), Loom from its Helm chart
  features   examples/featureview-driver-stats.yaml registered, materialized, served
  training   examples/trainingjob-fsdp-chargpt.yaml on 2 workers, one killed mid-run, resumed from its checkpoint
  serving    examples/inferenceservice-chargpt-from-trainingjob.yaml, a generation streamed token by token
  graph      examples/inferencegraph-ab-splitter.yaml in front of it (and a challenger)
  autoscale  examples/inferenceservice-queue-depth-scale-to-zero.yaml: scale-up under load, to zero and back
  pictures   the loss curve (PNG) from the MLflow run, a screenshot of the run page (headless Chromium)

`runner` runs them, times them and prints the summary; `ui` is the terminal output (rich; plain lines when
stdout is not a terminal). LOOM_DEMO_KEEP=1 leaves everything running.
"""
