"""autoscale."""
