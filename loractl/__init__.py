"""loractl: Ollama for LoRA adapters, on vLLM.

The client side: the CLI, the async :class:`Client` the CLI itself uses, the wire protocol and
the file layout. Nothing here imports torch or vllm.
"""

__version__ = "0.1.0"


def __getattr__(name: str):
    # Lazy, so `import loractl` stays cheap for tools that only need the version.
    if name == "Client":
        from loractl.client import Client

        return Client
    raise AttributeError(name)


__all__ = ["Client", "__version__"]
