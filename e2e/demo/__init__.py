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
stdout is not a terminal). LOOM_DEMO_KEEP=1 leaves everything running. The features part runs on in the
background while the TrainingJob trains (its outcome is printed after part 3); part 4 starts part 5's challenger;
part 6 shortens the example's idleSeconds in the object's spec (and says so).

Each part's story is also an e2e test (`make test`), so the demo cannot silently break:

  install    test_helm_install.py::test_operator_runs_in_cluster_under_the_charts_service_account (and every
             test_examples.py case, which runs the operator from the chart)
  features   test_featureview.py::test_example_feature_view_is_registered_materialized_and_served
  training   test_examples.py::test_example_runs[trainingjob-fsdp-chargpt.yaml] (the file as written);
             test_trainingjob_training.py::test_killed_worker_recovers_from_checkpoint_and_succeeds (a SIGKILLed
             worker, phase Restarting, progress never below the checkpoint, resume tagged in the MLflow run)
  serving    test_examples.py::test_example_runs[inferenceservice-chargpt-from-trainingjob.yaml]; streaming:
             test_scale_to_zero.py and test_inferencegraph.py::test_generation_streams_through_a_sequence_...
  graph      test_inferencegraph.py::test_examples_as_written (ab-test's 80/20 split over 1,000 requests)
  autoscale  test_examples.py::test_example_runs[inferenceservice-queue-depth-scale-to-zero.yaml];
             test_autoscaling_dynamics.py::test_queue_depth_from_real_requests_scales_the_chargpt_server_up;
             test_scale_to_zero.py::test_scales_to_zero_holds_and_wakes_streams_through_and_bounds_the_wait
  pictures   the loss history: test_trainingjob_training.py (assert_trained reads it from MLflow); the resume tag:
             the kill test above; the drawing and the tag parsing: tests/unit/test_demo.py. The screenshot needs
             Chromium, which `make test` does not: it is the demo's own (it says how to install Chromium).
"""
