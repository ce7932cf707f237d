"""Ray placement of the router, drafters and verifiers: ``specdec up`` / ``status`` / ``down``."""
