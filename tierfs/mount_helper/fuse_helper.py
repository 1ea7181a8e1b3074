"""The FUSE mount helper convention: `mount -t fuse.tierfs SOURCE DIR -o OPTIONS` and
/etc/fstab lines.

mount(8) runs `/sbin/mount.fuse.tierfs SOURCE DIR -o OPTIONS` when that program exists (the
`mount.fuse.tierfs` entry point, linked there), else `/sbin/mount.fuse3`, which runs
`tierfs SOURCE DIR -o OPTIONS` through /bin/sh's default PATH (mount(8) drops the caller's).
Both forms are turned here into `tierfs mount DIR --name value ...`: every mount option is
`-o name=value` (dashes or underscores), a flag is `-o name`, and a comma inside a value is
written `\\,`. The options that mount(8) and fstab add for themselves (`rw`, `nosuid`,
`noauto`, `_netdev`, `x-systemd.*`, ...) mean nothing to tierfs and are dropped. A SOURCE
`tierfs:/dev/shm/ckpt` (what /proc/mounts shows) names the RAM dir.
"""

from __future__ import annotations

import re
from collections.abc import Collection

from tierfs.mount_helper.config import MOUNT_OPTIONS, ConfigError
from tierfs.mount_helper.mounts import SOURCE_PREFIX

# Set by mount(8), fstab or systemd for themselves; tierfs always mounts nosuid,nodev.
GENERIC = frozenset({"rw", "defaults", "auto", "noauto", "user", "nouser", "users", "owner",
                     "group", "_netdev", "nofail", "suid", "nosuid", "dev", "nodev", "exec",
                     "noexec", "async", "sync", "atime", "noatime", "relatime", "norelatime",
                     "strictatime", "diratime", "nodiratime", "lazytime", "nolazytime",
                     "silent", "loud", "default_permissions"})
GENERIC_PREFIXES = ("x-", "comment=", "fsname=", "subtype=", "setuid=")
SWITCHES_WITHOUT_VALUE = frozenset({"-n", "-s", "-f", "-v", "--fake", "--no-mtab", "--sloppy",
                                    "--verbose"})
_FLAGS = {o.name for o in MOUNT_OPTIONS if o.kind == "flag"}
_VALUED = {o.name for o in MOUNT_OPTIONS if o.kind != "flag"} | {"config"}
_TRUE, _FALSE = ("", "1", "true", "yes", "on"), ("0", "false", "no", "off")


def is_helper_form(argv: list[str], commands: Collection[str]) -> bool:
    """`SOURCE DIR [-o OPTIONS]`: two operands, the first not one of tierfs's `commands`."""
    operands = _operands(argv)[0]
    return len(operands) == 2 and operands[0] not in commands


def to_mount_argv(argv: list[str]) -> list[str]:
    """`SOURCE DIR -o a=1,b` as the arguments of `tierfs mount`."""
    (source, mountpoint), options = _operands(argv)
    args = ["mount", mountpoint]
    named = set()
    for option in options:
        name, has_value, value = option.partition("=")
        if name in GENERIC or option.startswith(GENERIC_PREFIXES):
            continue
        if name == "ro":
            raise ConfigError("tierfs cannot be mounted read-only (-o ro)")
        flag = name.replace("_", "-")
        named.add(flag)
        if flag in _FLAGS:
            if value.lower() not in _TRUE + _FALSE:
                raise ConfigError(f"-o {option}: {name} is a flag (give it alone or =1/=0)")
            if value.lower() in _TRUE:
                args.append("--" + flag)
        elif flag in _VALUED:
            if not has_value or not value:
                raise ConfigError(f"-o {name} needs a value: -o {name}=...")
            args += ["--" + flag, value]
        else:
            raise ConfigError(f"unknown mount option -o {name} (tierfs options are its "
                              "--options without the dashes, e.g. -o ram_dir=/dev/shm/ckpt)")
    if source.startswith(SOURCE_PREFIX) and "ram-dir" not in named:
        args += ["--ram-dir", source[len(SOURCE_PREFIX):]]
    return args


def _operands(argv: list[str]) -> tuple[list[str], list[str]]:
    """(operands, mount options) of a helper command line; switches mount(8) adds (-n, -s,
    -f, -v, -t TYPE, -N NAMESPACE) are dropped."""
    operands: list[str] = []
    options: list[str] = []
    items = iter(argv)
    for item in items:
        if item == "-o":
            options += split_options(next(items, ""))
        elif item.startswith("-o") and len(item) > 2:
            options += split_options(item[2:])
        elif item in ("-t", "-N", "--type", "--namespace"):
            next(items, None)
        elif item in SWITCHES_WITHOUT_VALUE or item.startswith("-t"):
            continue
        else:
            operands.append(item)
    return operands, options


def split_options(text: str) -> list[str]:
    r"""'a=1,b,c=x\,y' -> ['a=1', 'b', 'c=x,y'] (a comma inside a value is escaped: `\,`)."""
    return [part.replace("\\,", ",") for part in re.split(r"(?<!\\),", text) if part]
