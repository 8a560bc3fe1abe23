"""One package per kind: its API model, its children and status (pure), its controller and its scaling adapter.

Importing this package imports nothing: `loom.operator.api` imports each kind's `api` module, so a package
`__init__` that imported the controller would make the API models depend on Kopf.
"""
