"""The daemon of one mount, which builds and connects parts and decides nothing itself:
`assembly.run` is what `tierfs mount` executes; `startup` checks and opens what a mount needs,
`commit_pipeline` builds what follows commits to the peers and the store, `cluster_service`
the node's side of the cluster, `control_api` answers `tierfs status` and the other control
requests, `admission` is what a node proves before it joins. The rules they wire are
`tierfs.replication`'s, `tierfs.retry`'s and the core's."""
