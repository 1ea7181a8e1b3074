"""Test and demo tooling: real servers on loopback (SeaweedFS, etcd) and the demo."""
