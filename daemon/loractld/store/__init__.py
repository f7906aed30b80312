"""loractld.store: adapters on disk: the store, its sources, pulls, validation, preflight, leases and GC."""
