"""End-to-end tier: the pytest plugins, the e2e tests and the demo, on top of loom.devstack. Dev and test only."""
