"""Node agent that runs pods as local processes."""
