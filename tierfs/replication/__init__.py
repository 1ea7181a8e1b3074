"""The cluster tier, in two packages with one-way dependencies: `coordination` (etcd: who is a
member, who holds which file, which steps are committed) and `peers` (the authenticated peer
protocol that moves the bytes, which asks `coordination` and is never asked by it). It consumes
the commit events of `tierfs.fs` and is a read source for files that are not in local RAM.
Beside them, the cluster's policy, which the daemon only wires: `commit_order` (copies before
uploads; which steps are planned again), `cluster_steps` (the cluster's commits listed here),
`catch_up` (what a node that was down corrects), `recorded_copies` (which records count)."""
