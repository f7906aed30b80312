"""The ``loractl`` command line: one module per command group, assembled in ``app``."""
