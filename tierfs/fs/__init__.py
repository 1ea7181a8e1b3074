"""The FUSE filesystem: the RAM store, the namespace (inodes, directories, steps, commit)
and the thin pyfuse3 Operations that expose them."""
