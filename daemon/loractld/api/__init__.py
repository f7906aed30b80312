"""The daemon's front ends, thin translations over ``loractld.core.Core``: the gRPC servicer
on the Unix socket (``grpc_service``) and the opt-in OpenAI-compatible HTTP API (``http``).
Each maps the core's domain errors to its own status codes and error schema."""
