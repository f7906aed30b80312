"""Who is calling and what they did: a peer's identity as the kernel reports it (``peers``) and
the audit log every state change writes (``audit``).

On the base floor (tests/test_layout.py): plain functions over the standard library and
``loractl.errors``, so the doors that identify a caller and the core's policy that judges it
(``loractld.core.policy``) both import them, and neither imports the other for it.
"""
