"""The NVIDIA Dynamo door: this daemon as a worker of a Dynamo fleet (``loractld --dynamo``).

A third door beside gRPC and HTTP, over the same :class:`loractld.core.Core`: Dynamo's frontend
tokenizes, routes by adapter and detokenizes; this worker registers the base model and one LoRA
card per stored adapter, serves the frontend's tokenized requests through the core and its
admission gate, and answers Dynamo's LoRA management calls (``/v1/loras``). The runtime
(``ai-dynamo-runtime``, the ``dynamo`` extra) is imported only when the door is on.
"""

from loractld.api.dynamo.settings import DynamoSettings, add_arguments, settings_from

__all__ = ["DynamoSettings", "add_arguments", "settings_from"]
