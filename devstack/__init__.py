"""The local real stack (dev and tests only; never in a container image, never imported by the operator).

- cluster/: the control plane built from Go modules, its PKI, processes and kwok nodes (`loom dev up`)
- agent/:   the node agent that runs pods as local processes (a stand-in for a kubelet)
- servers:  real backing services started on this machine (S3-compatible store, MLflow tracking)
- cli:      the `loom dev` command group, found by `loom` through the `loom.cli` entry-point group
"""
