"""Sharded, asynchronous, atomically committed checkpoints in S3."""
