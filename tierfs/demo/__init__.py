"""`tierfs demo` (run.py: train, checkpoint, crash and resume on a local mount) and the throwaway
local servers it starts on loopback (seaweed.py: SeaweedFS as an S3 store; etcd.py: etcd for
the cluster; local_server.py: what they share), which the tests and the benchmark start too."""
