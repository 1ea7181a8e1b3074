"""The FUSE file system, in layers; each sub-package imports only those below it
(tests/test_structure.py checks):

- `fuse/`: the face the kernel sees: pyfuse3's Operations, the passthrough relay, FUSE messages.
- `namespace.py`: the one object the FUSE face and the daemon talk to, composing the rest.
- `lifecycle/`: what happens to a step over time: commits (marked, quiet, appended), copies on
  other tiers, files fetched back and evicted, verification, recovery at start-up, deletes,
  background work.
- `tree/`: the namespace core: the `Tree` and the parts it changes itself through.
- `model/`: plain data (inodes, step state) and pure rules over it, and the ports: every call
  fs makes outward, as Protocols.
- `store/`: bytes on this node: the RAM store and fetching bytes back into it from other tiers."""
