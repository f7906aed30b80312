"""loractld: the loractl daemon. One vLLM engine, LoRA adapters across disk -> host -> device."""

from loractl import __version__

__all__ = ["__version__"]
