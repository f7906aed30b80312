"""The opt-in OpenAI-compatible HTTP API (``loractld --http HOST:PORT``).

``settings`` (flags, checks) is standard library only; ``app``, ``serving``, ``models``,
``protocol`` and ``server`` import FastAPI/uvicorn, and are imported only when the API is on.
"""
