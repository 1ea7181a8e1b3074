"""The cluster's coordination, on etcd: the client (etcd.py, over its JSON gateway), membership
under leases, ring placement and restore plans, the per-file and commit records, the cluster
side of a commit (cluster_commit.py), the store record and the token check. It moves no bytes
between nodes (that is `replication.peers`) and imports nothing from `replication.peers`."""
