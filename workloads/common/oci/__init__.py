"""Models as OCI images (issue 48): the reference grammar, the image layout (ModelPack's annotations on regular tar
layers, which container runtimes mount), deterministic layers, the registry's HTTP API (OCI distribution) and the
push and pull of a model folder. Shared by the SDK's `loom model push`, the operator (a tag resolved to its digest)
and the tests; nothing here imports torch or a cloud SDK."""
