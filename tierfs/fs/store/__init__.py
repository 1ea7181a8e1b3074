"""Bytes on this node: the RAM store's layout, capacity and committed objects (ram_store.py),
paths into it longer than PATH_MAX (long_paths.py), and a committed file's bytes fetched back
into it from another tier, verified (fetch.py), with the errors the tiers raise (tier_errors.py)."""
