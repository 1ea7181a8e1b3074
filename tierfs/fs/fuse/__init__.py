"""The file system's face to the kernel: pyfuse3's Operations over the Namespace (operations.py),
the FUSE passthrough relay (passthrough.py) and the FUSE messages it edits (fuse_wire.py)."""
