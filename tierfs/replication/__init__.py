"""The cluster tier, in two packages with one-way dependencies: `coordination` (etcd: who is a
member, who holds which file, which steps are committed) and `peers` (the authenticated peer
protocol that moves the bytes, which asks `coordination` and is never asked by it). It consumes
the commit events of `tierfs.fs` and is a read source for files that are not in local RAM."""
