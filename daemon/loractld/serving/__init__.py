"""loractld.serving: admission, tiers and pins: everything that must agree on slot counts."""
