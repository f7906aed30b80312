"""``python -m loractld``: the daemon's command line, as ``loractld`` runs it (``loractld.main``)."""

from loractld.main import main

main()
