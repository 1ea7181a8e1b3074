"""The FUSE filesystem: the RAM store, the `Tree` (inodes, directories, steps, object
references) with its collaborators (residency, other tiers, commits, recovery, verification),
the `Namespace` that composes them, and the thin pyfuse3 Operations that expose it."""
