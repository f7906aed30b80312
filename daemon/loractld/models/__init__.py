"""loractld.models: base models: the tiny test model, the demo, GGUF import, defaults derived from a model."""
