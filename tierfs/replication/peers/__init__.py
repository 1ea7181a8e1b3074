"""The peers: moving bytes between nodes. The sans-IO peer protocol (protocol.py), its trio
channel and server, the pool of kept-alive connections, the live peer list (directory.py, from
`replication.coordination`), copies of committed files to K more nodes (replicator.py) and
storing theirs (receiver.py), reads, deletes and checks served to peers, and where a reader
fetches each chunk from (sources.py)."""
