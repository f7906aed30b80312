"""loractld.worker: code that runs inside vLLM's processes: an exception here ends the engine."""
