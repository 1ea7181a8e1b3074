"""The etcd-backed cluster layer (issue 13), replacing replication/membership.py and gossip.py:
membership under leases, the replica ring and placement, and per-file shard and commit records."""
