"""The etcd-backed cluster layer: membership under leases, the replica ring and placement, and
per-file shard and commit records (`replication` moves the bytes between nodes)."""
