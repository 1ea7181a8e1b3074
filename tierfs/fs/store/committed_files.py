"""A committed file made again in the RAM tier from what its manifest entry records: its bytes
from the committed object of its digest, its mode, owner and mtime from the entry.

Files of identical content share one object, and a tree file linked to an object shares its
inode, so its mode, owner and mtime too: a link is made only where the object has the entry's
attributes, or where nothing else shares the object (it then takes them); elsewhere the file is
a copy of its own. Before this, a restart linked every committed file to its object whatever its
attributes, and files of equal bytes in other steps (HF's config.json in every checkpoint, a
shard saved again unchanged) came back with one another's mode, owner and mtime.
"""

from __future__ import annotations

import os
import shutil
import stat

from tierfs import manifest as mf


def apply_attributes(target: int | bytes | str, entry: mf.FileEntry) -> None:
    """Give a regular file (a path or an fd) made again from a committed entry (fetched,
    received from a peer, linked from an object) the owner, mode and mtime recorded at commit.
    Owner first: chown clears set-id bits that chmod then sets."""
    if entry.uid != mf.NO_OWNER and entry.gid != mf.NO_OWNER:
        os.chown(target, entry.uid, entry.gid)
    os.chmod(target, entry.mode)
    if entry.mtime_ns:
        os.utime(target, ns=(entry.mtime_ns, entry.mtime_ns))


def has_attributes(st: os.stat_result, entry: mf.FileEntry) -> bool:
    """Whether a file with these attributes has the entry's mode, owner and mtime."""
    return (stat.S_IMODE(st.st_mode) == entry.mode
            and (entry.uid == mf.NO_OWNER or entry.gid == mf.NO_OWNER
                 or (st.st_uid, st.st_gid) == (entry.uid, entry.gid))
            and (not entry.mtime_ns or st.st_mtime_ns == entry.mtime_ns))


def make_from_object(obj: os.PathLike[str] | bytes | str, path: bytes, tmp: bytes,
                     entry: mf.FileEntry) -> None:
    """Make `path` (not the object's inode already) the committed file `entry`, whose bytes
    are the object `obj`: a link to it, renamed into place from `tmp` (a free name in its
    directory), then given the entry's attributes as `give_attributes` does."""
    os.link(obj, tmp)
    os.rename(tmp, path)
    give_attributes(obj, path, tmp, entry)


def give_attributes(obj: os.PathLike[str] | bytes | str, path: bytes, tmp: bytes,
                    entry: mf.FileEntry) -> bool:
    """Give the file at `path` (the bytes of `entry`, whose object is `obj`) the entry's mode,
    owner and mtime, without changing another file's: where it shares its inode with another
    file than the object, it becomes a copy of its own first (built at `tmp`: the caller
    accounts for its bytes). Whether anything changed."""
    st = os.lstat(path)
    if has_attributes(st, entry):
        return False
    try:
        own_names = 2 if os.path.samestat(st, os.lstat(obj)) else 1
    except FileNotFoundError:
        own_names = 1
    if st.st_nlink <= own_names:
        apply_attributes(path, entry)
        return True
    shutil.copyfile(path, tmp)
    apply_attributes(tmp, entry)
    os.rename(tmp, path)
    return True
