"""loractld.engine: vLLM's AsyncLLM and its serving classes, the request path's vLLM side, and version compat (engine/ and worker/ alone import vllm)."""
