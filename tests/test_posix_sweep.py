"""Every namespace operation a shell or a saver makes, on every kind of entry a mount holds
(the committed step's bytes in RAM, or only in the store), on tierfs and on tmpfs side by side:
the outcomes (success or the errno) must be the same, but for the differences tierfs's contract
states (SEMANTICS.md), and none may be EIO, the daemon's answer to an error of its own. The
same through open descriptors after the file's name changed. A rename of a symbolic link failed
with EIO (`ln -sfn step_2 latest` over an existing link) and an fchmod after an unlink with
ENOENT until these sweeps tried them."""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import stat
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.conftest import Mount, MountFactory, own_tmpfs, tierfs
from tests.waiting import wait_until

pytestmark = pytest.mark.fuse

# The kinds of entry: a committed step and what is in it, a step being written, a loose file,
# a plain directory, symbolic links (kept with their directory), a FIFO, `latest`, a run dir
# and a name that does not exist. A newer committed step, step_3, is there too: with
# --keep-ram 1, step_1 leaves RAM once it is in the store.
ENTRIES = ["run/step_1", "run/step_1/sub", "run/step_1/sub/f", "run/step_1/.metadata",
           "run/step_2", "run/step_2/w", "loose.pt", "plain", "sym", "run/best", "fifo",
           "run/latest", "run", "run/step_1/nonexist"]


def _write(path: str, data: bytes, flags: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK | flags, 0o644)  # (a FIFO: ENXIO)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


_LIBC = ctypes.CDLL(None, use_errno=True)
RENAME_NOREPLACE, RENAME_EXCHANGE = 1, 2


def _renameat2(old: str, new: str, flags: int) -> None:
    if _LIBC.renameat2(-100, os.fsencode(old), -100, os.fsencode(new), flags) != 0:  # AT_FDCWD
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), old)


def _shell(*command: str) -> None:
    done = subprocess.run(command, capture_output=True)
    if done.returncode:
        # the first errno the tool names ("Input/output error", "Permission denied", ...)
        message = done.stderr.decode()
        code = next((code for code, text in ((c, os.strerror(c)) for c in errno.errorcode)
                     if text in message), errno.EINVAL)
        raise OSError(code, message)


# Operations on an entry `p` (ON_ONE), and on `p` and a second entry `q` (ON_TWO).
ON_ONE: dict[str, Callable[[str], object]] = {
    "chmod": lambda p: os.chmod(p, 0o700),
    "chown": lambda p: os.chown(p, 1000, 1000, follow_symlinks=False),
    "utime": lambda p: os.utime(p, ns=(1, 2), follow_symlinks=False),
    "truncate": lambda p: os.truncate(p, 10),
    "setxattr": lambda p: os.setxattr(p, "user.x", b"1", follow_symlinks=False),
    "removexattr": lambda p: os.removexattr(p, "user.x", follow_symlinks=False),
    "listxattr": lambda p: [n for n in os.listxattr(p, follow_symlinks=False)
                            if not n.startswith("user.tierfs.")],
    "open_r": lambda p: os.close(os.open(p, os.O_RDONLY | os.O_NONBLOCK)),
    "write_over": lambda p: _write(p, b"o" * 10, os.O_TRUNC | os.O_CREAT),
    "append": lambda p: _write(p, b"a", os.O_APPEND),
    "unlink": os.unlink,
    "rmdir": os.rmdir,
    "rm_r": lambda p: _shell("rm", "-rf", p),
    "listdir": os.listdir,
    "readlink": os.readlink,
    "create_in": lambda p: _write(os.path.join(p, "new.bin"), b"n", os.O_CREAT),
    "mkdir_in": lambda p: os.mkdir(os.path.join(p, "newdir")),
    "symlink_in": lambda p: os.symlink("x", os.path.join(p, "newlink")),
}
ON_TWO: dict[str, Callable[[str, str], object]] = {
    "rename": os.rename,
    "rename_into": lambda p, q: os.rename(q, os.path.join(p, "moved")),
    "exchange": lambda p, q: _renameat2(p, q, RENAME_EXCHANGE),
    "noreplace": lambda p, q: _renameat2(p, q, RENAME_NOREPLACE),
    "ln_sfn": lambda p, q: _shell("ln", "-sfn", os.path.basename(p), q),
}


def cases(touching: str = "") -> Iterator[tuple[str, str, str]]:
    """Every operation on every entry (and pair of entries); `touching`: only those with an
    entry below that path."""
    def wanted(*entries: str) -> bool:
        return any(entry.startswith(touching) for entry in entries if entry)

    for name in ON_ONE:
        for entry in ENTRIES:
            if wanted(entry):
                yield name, entry, ""
    for name in ON_TWO:
        for entry in ENTRIES:
            for other in ENTRIES:
                if wanted(entry, other):
                    yield name, entry, other


def build(root: Path, on_tmpfs: bool) -> None:
    """The same entries under `root`; on tmpfs `latest` is an ordinary symbolic link."""
    (root / "run/step_1/sub").mkdir(parents=True)
    (root / "run/step_1/sub/f").write_bytes(b"f" * 5000)
    (root / "run/step_1/.metadata").write_bytes(b"m")  # commits step_1 on tierfs
    (root / "run/step_3").mkdir()
    (root / "run/step_3/.metadata").write_bytes(b"3")
    (root / "run/step_2").mkdir()
    (root / "run/step_2/w").write_bytes(b"w" * 100)  # step_2 is being written
    (root / "loose.pt").write_bytes(b"l" * 100)
    (root / "plain").mkdir()
    os.symlink("loose.pt", root / "sym")
    os.symlink("step_1", root / "run/best")
    os.mkfifo(root / "fifo")
    if on_tmpfs:
        os.symlink("step_3", root / "run/latest")


def outcomes(base: Path, on_tmpfs: bool, touching: str = "",
             ready: Callable[[], object] = lambda: None
             ) -> tuple[dict[tuple[str, str, str], str], list[str]]:
    """Each case's outcome ("ok" or the errno's name), each on a tree of its own made before
    `ready()` is called, and every EIO seen, in the operation or in a walk of its tree
    afterwards."""
    all_cases = list(cases(touching))
    for number, _case in enumerate(all_cases):
        build(base / f"case{number}x", on_tmpfs)  # (a bare number is a step name)
    ready()
    found: dict[tuple[str, str, str], str] = {}
    eio: list[str] = []
    for number, (name, entry, other) in enumerate(all_cases):
        root = base / f"case{number}x"
        try:
            if other:
                ON_TWO[name](str(root / entry), str(root / other))
            else:
                ON_ONE[name](str(root / entry))
            found[name, entry, other] = "ok"
        except OSError as exc:
            found[name, entry, other] = errno.errorcode.get(exc.errno or 0, str(exc.errno))
            if exc.errno == errno.EIO:
                eio.append(f"{name} {entry} {other}: {exc}")
        for directory, dirs, files in os.walk(root):
            for child in dirs + files:
                try:
                    os.lstat(os.path.join(directory, child))
                except OSError as exc:
                    if exc.errno == errno.EIO:
                        eio.append(f"lstat after {name} {entry} {other}: {exc}")
    return found, eio


def stated_difference(case: tuple[str, str, str], here: str, on_tmpfs: str) -> bool:
    """Whether tierfs's contract says this case differs from tmpfs (SEMANTICS.md)."""
    name, entry, other = case
    touches = {entry, other}
    if here == "EROFS" and "run/latest" in touches:  # `latest` is read-only
        return True
    moves = ("rename", "rename_into", "noreplace", "exchange")
    if here == "EPERM" and "fifo" in touches and name in moves \
            and on_tmpfs == "ok":  # a FIFO may not move into a step
        return True
    return here == "EINVAL" and name == "exchange"  # RENAME_EXCHANGE is refused


@pytest.mark.parametrize("where", ["ram", "store"])
def test_every_operation_on_every_kind_of_entry_answers_as_tmpfs_does(
        mounts: MountFactory, tmp_path: Path, where: str) -> None:
    """`store`: the committed step_1 is only in the store (persisted, then evicted: --keep-ram
    1), and the operations are those on it and in it (the others are the same as in RAM)."""
    if where == "ram":
        touching = ""
        mnt = mounts.mount()
        here, here_eio = outcomes(mnt / "sweep", on_tmpfs=False)
    else:
        touching = "run/step_1"
        (tmp_path / "store").mkdir()
        mnt = mounts.mount("--persist", f"file://{tmp_path / 'store'}", "--keep-ram", "1")

        def evicted() -> None:
            tierfs("flush", str(mnt.mountpoint), "--timeout", "300", timeout=330)
            wait_until(lambda: not any(step["ram"] for step in mnt.status()["steps"]
                                       if step["path"].endswith("/run/step_1")), timeout=60)

        here, here_eio = outcomes(mnt / "sweep", on_tmpfs=False, touching=touching,
                                  ready=evicted)
    with own_tmpfs(tmp_path / "tmpfs", "256M") as tmpfs:
        reference, reference_eio = outcomes(tmpfs / "sweep", on_tmpfs=True, touching=touching)
        shutil.rmtree(tmpfs / "sweep")
    assert not reference_eio
    assert not here_eio, "\n".join(here_eio)
    differences = [f"{' '.join(case)}: tierfs {here[case]}, tmpfs {reference[case]}"
                   for case in reference if here[case] != reference[case]
                   and not stated_difference(case, here[case], reference[case])]
    assert not differences, "\n".join(differences)
    assert "internal error" not in mnt.log()


# Through an open descriptor: what became of the file's name first, then one call on the
# descriptor; afterwards every name's bytes and mode are compared too.
OPEN_FILES = ["run/step_1/sub/f", "run/step_1/.metadata", "run/step_2/w", "loose.pt"]
NAME_CHANGES: dict[str, Callable[[Path, str], object]] = {
    "kept": lambda root, entry: None,
    "unlinked": lambda root, entry: os.unlink(root / entry),
    "renamed_away": lambda root, entry: os.rename(root / entry, root / "plain/moved"),
    "replaced": lambda root, entry: (
        (root / "plain/new").write_bytes(b"new"), os.rename(root / "plain/new", root / entry)),
    "dir_removed": lambda root, entry: _shell("rm", "-rf", str((root / entry).parent)),
    "dir_renamed": lambda root, entry: os.rename((root / entry).parent,
                                                 root / "plain/dir_moved"),
}
ON_DESCRIPTOR: dict[str, Callable[[int], object]] = {
    "fstat": lambda fd: (lambda st: (st.st_size, st.st_nlink, oct(st.st_mode)))(os.fstat(fd)),
    "fchmod": lambda fd: os.fchmod(fd, 0o600),
    "fchown": lambda fd: os.fchown(fd, 1000, 1000),
    "futimens": lambda fd: os.utime(fd, ns=(1, 2_000_000_000)),
    "ftruncate": lambda fd: os.ftruncate(fd, 3),
    "pwrite": lambda fd: os.pwrite(fd, b"P" * 10, 2),
    "pread": lambda fd: os.pread(fd, 20, 0),
    "fsync": os.fsync,
    "fsetxattr": lambda fd: os.setxattr(fd, "user.x", b"1"),
}


def fd_cases() -> Iterator[tuple[str, str, str]]:
    for entry in OPEN_FILES:
        for change in NAME_CHANGES:
            for call in ON_DESCRIPTOR:
                yield entry, change, call


def tree_contents(root: Path) -> dict[str, tuple[str, bytes]]:
    """Every file under `root`: its mode and bytes (FIFOs and links by their kind alone)."""
    found = {}
    for directory, _dirs, files in os.walk(root):
        for name in files:
            path = Path(directory, name)
            mode = os.lstat(path).st_mode
            data = path.read_bytes() if stat.S_ISREG(mode) else b""
            found[str(path.relative_to(root))] = (oct(mode), data)
    return found


def fd_outcomes(base: Path, on_tmpfs: bool) -> tuple[dict[tuple[str, str, str], object],
                                                     list[str]]:
    """Each case's outcome (the call's result, or its errno's name) and the tree's files
    after the descriptor is closed; every EIO seen."""
    all_cases = list(fd_cases())
    for number, _case in enumerate(all_cases):
        build(base / f"case{number}x", on_tmpfs)
    found: dict[tuple[str, str, str], object] = {}
    eio = []
    for number, (entry, change, call) in enumerate(all_cases):
        root = base / f"case{number}x"
        fd = os.open(root / entry, os.O_RDWR)
        try:
            NAME_CHANGES[change](root, entry)
            result: object = ON_DESCRIPTOR[call](fd)
        except OSError as exc:
            result = errno.errorcode.get(exc.errno or 0, str(exc.errno))
            if exc.errno == errno.EIO:
                eio.append(f"{entry} {change} {call}: {exc}")
        finally:
            os.close(fd)
        contents = {name: file for name, file in tree_contents(root).items()
                    if not name.startswith("run/latest")}
        found[entry, change, call] = (result, contents)
    return found, eio


def test_calls_through_a_descriptor_whose_name_changed_answer_as_tmpfs_does(
        mnt: Mount, tmp_path: Path) -> None:
    """fstat, fchmod, fchown, futimens, ftruncate, pwrite, pread, fsync and fsetxattr through
    a descriptor opened for writing on a committed file, a file of a step being written and a
    loose file, after its name was kept, unlinked, renamed away, replaced by a rename, or its
    directory removed or renamed: the same result and, once it is closed, the same files with
    the same bytes and modes as on tmpfs (fchmod and the like failed with ENOENT once the
    name was gone)."""
    here, here_eio = fd_outcomes(mnt / "sweep", on_tmpfs=False)
    with own_tmpfs(tmp_path / "tmpfs", "64M") as tmpfs:
        reference, reference_eio = fd_outcomes(tmpfs / "sweep", on_tmpfs=True)
        shutil.rmtree(tmpfs / "sweep")
    assert not reference_eio
    assert not here_eio, "\n".join(here_eio)
    differences = []
    for case, (result, files) in reference.items():
        here_result, here_files = here[case]
        if here_result != result:
            differences.append(f"{' '.join(case)}: tierfs {here_result}, tmpfs {result}")
        for name in sorted(files.keys() | here_files.keys()):
            if here_files.get(name) != files.get(name):
                differences.append(f"{' '.join(case)}, then {name}: tierfs "
                                   f"{here_files.get(name)}, tmpfs {files.get(name)}")
    assert not differences, "\n".join(differences[:20])
    assert "internal error" not in mnt.log()
