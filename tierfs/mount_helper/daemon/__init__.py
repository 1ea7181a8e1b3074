"""The daemon of one mount: `assembly.run` is what `tierfs mount` executes; `startup` checks and
opens what a mount needs, `commit_pipeline` follows commits to the peers and the store,
`cluster_service` is the node's side of the cluster, `control_api` answers `tierfs status` and
the other control requests, `admission` is what a node proves before it joins."""
