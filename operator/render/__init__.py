"""Pure rendering, one module per kind: spec + observed state -> child manifests, status and events (no I/O).

Shared pieces (Manifest, owner references, labels, S3 env, conditions, Event, status patches, time) live in
`kit.py`, so every kind's children look alike.
"""
