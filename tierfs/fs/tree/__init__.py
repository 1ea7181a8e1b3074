"""The namespace core: the `Tree` (tree.py), the only code that changes nodes, step state and
the RAM store's references, through its parts (each one concern: residents, step manifests,
step identity, renames, attributes, copy on write, sealing...), and the tree read (tree_view.py)."""
