"""Where a step's bytes and records live, in the mount, the RAM store and the persistent tier:
the one place that knows it (the tree, recovery, the uploader, the reader and deletes use it).

A step directory `P` keeps its files under `P/` and its records (manifest, persisted and
replica marks) beside them, in `P/.tierfs-manifest` and friends. A single-file step (a file
step such as `run/epoch=0-step=5.ckpt`, or a loose file such as `run/last.ckpt`) keeps its
bytes where the file is, `run/epoch=0-step=5.ckpt` (the same bytes under the same key, so
that standard tools read the store), and its records in a reserved directory beside it,
`run/.tierfs-file-epoch=0-step=5.ckpt/`. The same paths serve as keys in the persistent tier.
No imports but `reserved`: the backends and the file system both use it.
"""

from __future__ import annotations

from tierfs import reserved


def join(directory: str, name: str) -> str:
    """`directory/name`, or `name` at the top (`directory` is "")."""
    return f"{directory}/{name}" if directory else name


def data_dir(path: str, single_file: bool) -> str:
    """The directory that a step's file entries are relative to."""
    return path.rpartition("/")[0] if single_file else path


def records_dir(path: str, single_file: bool) -> str:
    """The directory that holds a step's manifest and marks."""
    if not single_file:
        return path
    parent, _, name = path.rpartition("/")
    return join(parent, reserved.FILE_RECORDS + name)


def manifest_key(path: str, single_file: bool) -> str:
    return f"{records_dir(path, single_file)}/{reserved.MANIFEST}"


def object_key(data: str, name: str) -> str:
    """The key of a file entry `name` of a step whose data dir is `data`."""
    return join(data, name)


def step_of_records_dir(records: str) -> tuple[str, bool]:
    """The step path that a records directory belongs to, and whether it is a single file."""
    parent, _, name = records.rpartition("/")
    if name.startswith(reserved.FILE_RECORDS):
        return join(parent, name[len(reserved.FILE_RECORDS):]), True
    return records, False


def records_name(file_name: bytes) -> bytes:
    """The name of a single-file step's records directory, beside the file."""
    return reserved.FILE_RECORDS.encode() + file_name


def file_of_records_name(name: bytes) -> bytes | None:
    """The file whose records directory this is, or None if it is no such directory."""
    prefix = reserved.FILE_RECORDS.encode()
    return name[len(prefix):] if name.startswith(prefix) else None


SEGMENT_PREFIX = "append."  # + the offset (20 digits): a segment of an appended loose file


def segment_key(file_key: str, offset: int) -> str:
    """The object holding the segment of the appended loose file `file_key` (its path) that
    starts at byte `offset`: in the file's records directory, named so that listing them in
    key order lists them in file order."""
    return f"{records_dir(file_key, True)}/{SEGMENT_PREFIX}{offset:020d}"


def piece_keys(file_key: str, segments: tuple[int, ...]) -> list[str]:
    """The objects that hold a file stored as a base and `segments`, in file order."""
    return [file_key, *(segment_key(file_key, offset) for offset in segments)]
