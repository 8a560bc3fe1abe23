"""The local real stack: control plane build and process management, node agent. Dev and test only."""
