"""loractld.engine: the engine, the only vLLM importer in the daemon process, and version compat."""
