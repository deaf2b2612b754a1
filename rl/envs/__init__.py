"""Environments, one per domain, registered by name (`base.make_env`)."""
