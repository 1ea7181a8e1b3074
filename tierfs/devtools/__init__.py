"""Developer tooling, kept apart from the product: the generator of doc/CONFIGURATION.md
(configuration_doc.py, `make docs`), certificates for tests, and the throwaway local servers
started on loopback (seaweed.py: SeaweedFS as an S3 store; etcd.py: etcd for the cluster;
local_server.py: what they share), which the demo, the tests and the benchmark start, and
the proxy that puts an object store's trouble in front of SeaweedFS (s3_proxy.py). Nothing
in tierfs outside this package but the demo imports it (tests/test_structure.py checks)."""
