"""The ``vllm`` runtime of an InferenceService: Loom's OpenAI-compatible front over the vLLM engine."""
