"""Plain data and pure rules the file system is made of: inodes, open files and step state
(nodes.py), walking them (tree_walk.py), pending commits, `latest` pins, symbolic links, DCP's
shard list, the layout of appended files; and the ports (ports.py): every call fs makes
outward, as typed Protocols."""
