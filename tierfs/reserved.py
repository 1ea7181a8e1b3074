"""Names tierfs keeps for itself, spelled once: inside a step directory, in the RAM dir and in
the persistent tier. Every one starts with PREFIX, which the mount never shows and users can
never create (`fs.store.ram_store.is_reserved`). No imports: the CLI, the manifest codec and the
backends all use these without pulling in the file system."""

PREFIX = ".tierfs-"

MANIFEST = PREFIX + "manifest"    # a step's committed manifest (RAM tier and persistent tier)
PENDING = PREFIX + "pending"      # a step committed whose files are not hashed yet (RAM tier)
SNAPSHOT = PREFIX + "snapshot-"   # in objects/: a file of such a step, until its hash names it
PERSISTED = PREFIX + "persisted"  # "<version> persisted|retired": the persistent tier's state
REPLICAS = PREFIX + "replicas"    # "<version> <node id>...": peers that hold this version
PEERS = PREFIX + "peers"          # "<version> <node id>...": a step learned from peers
FILE_RECORDS = PREFIX + "file-"  # + a file's name: the records of that single-file step
LINKS = PREFIX + "links"          # in the persistent tier: a directory's symbolic links
OWN_LATEST = PREFIX + "own-latest"  # in a directory: its `latest` is its own, never virtual
NAMED_STEP = PREFIX + "named-step"  # "<number>": a directory a tracker named, a step whatever
                                    # its name (a DeepSpeed tag of the job's own)
TMP = PREFIX + "tmp-"             # a file on its way into place (removed at start)
PART = PREFIX + "part-"           # a file being fetched from another tier
INCOMING = PREFIX + "incoming-"   # a replica's file being received from a peer
TRASH = PREFIX + "trash-"         # an object on its way out (removed at start)
UPLOAD = PREFIX + "upload"        # an upload to a file:// persistent tier under way
STORE = PREFIX + "store"          # marks the root of a persistent tier
PACK = PREFIX + "pack-"           # + a number: in the persistent tier, small files packed
PACKS = PREFIX + "packs"          # in the persistent tier: the index of a step's packs
PROBE = PREFIX + "probe-"         # the start-up check that the RAM dir is writable
TEMP_SUFFIX = ".tmp"              # a reserved file written beside its final name
