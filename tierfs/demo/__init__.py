"""`tierfs demo` (run.py: train, checkpoint, crash and resume on a local mount), on the throwaway
local servers of `tierfs.devtools` (SeaweedFS as an S3 store, etcd for the cluster)."""
