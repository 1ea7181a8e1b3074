"""Cluster tier (not built yet): membership, ring placement, the authenticated peer protocol,
the replica store and remote reads. It will consume the commit events that `tierfs.fs` sends
and serve as a read source for files that are not in local RAM."""
