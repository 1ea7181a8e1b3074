"""Cluster tier: the peers of this node (`membership`, from etcd), the authenticated
sans-IO peer protocol (`protocol`) and its trio channel and server (`channel`, `server`),
copies of each committed file on K more nodes, as etcd's file records say (`replicator`), and
storing theirs (`receiver`), reads,
deletes and checks served to peers (`peer_reader`, `peer_delete`, `peer_verify`), and the
multi-node commit of DCP checkpoints (`cluster_commit`). It consumes the commit events of
`tierfs.fs` and is a read source for files that are not in local RAM."""
