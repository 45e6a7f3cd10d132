"""The remote tier: the store contract (`connector`), Redis/Valkey (`redis`),
the value format (`store`), probes and health (`tier`) and plan ops (`ops`)."""
