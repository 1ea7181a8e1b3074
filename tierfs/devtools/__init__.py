"""Test and demo tooling, kept apart from the product: `tierfs demo` (demo.py) and launchers
of throwaway local servers for tests, benchmarks and the demo (seaweed.py: SeaweedFS as an S3
store; etcd.py: etcd for the cluster). Nothing in the mount helper, the daemon or the tiers
imports this package."""
