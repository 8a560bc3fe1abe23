"""What every kind shares: the reconcile runner, the render kit, the Kubernetes client, leadership and events."""
