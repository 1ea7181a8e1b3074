"""Mount configuration: options from the command line, `TIERFS_*` variables and a TOML file.

Precedence is command line, then environment, then `--config` file, then the default. Values are
validated here so that a mistake is one clear line (ConfigError) before anything is mounted.
"""

from __future__ import annotations

import os
import re
import socket
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tierfs.fs.namespace import DEFAULT_STEP_PATTERN


class ConfigError(Exception):
    """A user's configuration mistake; printed as one line."""


@dataclass(frozen=True)
class Option:
    name: str
    default: Any
    help: str
    kind: str = "str"  # str, int, size, path, flag
    metavar: str = ""


MOUNT_OPTIONS = [
    Option("foreground", False, "stay in the foreground and log to stderr", "flag"),
    Option("ram-dir", "/dev/shm/tierfs", "where the RAM tier keeps its data; must be on tmpfs "
           "to be RAM (default %(default)s)", "path", "DIR"),
    Option("ram-limit", "50%", "bytes (64G, 512M) or percent of memory (50%%) the RAM tier may "
           "hold (default %(default)s)", "size", "SIZE"),
    Option("keep-ram", 3, "committed steps kept in RAM per run directory; older ones leave RAM "
           "only once safe in another tier (default %(default)s)", "int", "N"),
    Option("persist", None, "persistent tier: s3://bucket/prefix or file:///abs/path "
           "(default: none, RAM only)", metavar="URL"),
    Option("persist-every", 1, "persist every N-th step, by step number (default %(default)s)",
           "int", "N"),
    Option("keep-persist", 0, "committed steps kept in the persistent tier per run directory; "
           "0 keeps all (default %(default)s)", "int", "N"),
    Option("s3-endpoint", None, "S3-compatible endpoint URL (default: AWS_ENDPOINT_URL, else "
           "AWS)", metavar="URL"),
    Option("node-id", None, "this node's name (default: the host name)", metavar="ID"),
    Option("step-pattern", DEFAULT_STEP_PATTERN, "regular expression for step directory names; "
           "group 1 is the step number (default %(default)s)", metavar="REGEX"),
    Option("log-file", None, "log destination when daemonised (default <ram-dir>/tierfs.log)",
           "path", "FILE"),
]


@dataclass(frozen=True)
class MountConfig:
    mountpoint: Path
    foreground: bool
    ram_dir: Path
    ram_limit: int
    keep_ram: int
    persist: str | None
    persist_every: int
    keep_persist: int
    s3_endpoint: str | None
    node_id: str
    step_pattern: str
    log_file: Path

    @property
    def control_socket(self) -> Path:
        return self.ram_dir / "control.sock"


_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([kmgtp]?)i?b?\s*$", re.IGNORECASE)


def parse_size(text: str | int, total_memory: int | None = None) -> int:
    """'64G', '512M', '1.5T', '4096' or '50%' (of memory) to bytes."""
    if isinstance(text, int):
        return text
    value = str(text).strip()
    if value.endswith("%"):
        try:
            percent = float(value[:-1])
        except ValueError:
            raise ConfigError(f"not a percentage: {text!r}") from None
        if not 0 < percent <= 100:
            raise ConfigError(f"percentage out of range: {text!r}")
        return int((total_memory or memory_bytes()) * percent / 100)
    match = _SIZE.match(value)
    if not match:
        raise ConfigError(f"not a size: {text!r} (use e.g. 64G, 512M or 50%)")
    number, unit = match.groups()
    return int(float(number) * 1024 ** "bkmgtp".index(unit.lower() or "b"))


def memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def resolve(mountpoint: str, cli: Mapping[str, Any], env: Mapping[str, str],
            config_file: str | None) -> MountConfig:
    """Merge the sources of every mount option and validate the result."""
    file_values: dict[str, Any] = {}
    if config_file:
        try:
            with open(config_file, "rb") as f:
                file_values = tomllib.load(f)
        except OSError as exc:
            raise ConfigError(f"cannot read config file {config_file}: {exc.strerror}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {config_file} is not valid TOML: {exc}") from None
        known = {o.name for o in MOUNT_OPTIONS} | {o.name.replace("-", "_") for o in MOUNT_OPTIONS}
        unknown = sorted(set(file_values) - known)
        if unknown:
            raise ConfigError(f"config file {config_file}: unknown option {unknown[0]!r}")
    values: dict[str, Any] = {}
    for option in MOUNT_OPTIONS:
        key = option.name.replace("-", "_")
        value = cli.get(key)
        if value is None or (option.kind == "flag" and value is False):
            env_value = env.get("TIERFS_" + key.upper())
            if env_value is not None:
                value = _from_env(option, env_value)
            elif option.name in file_values or key in file_values:
                value = file_values.get(option.name, file_values.get(key))
            else:
                value = option.default
        values[key] = value
    return _validate(mountpoint, values)


def _from_env(option: Option, text: str) -> Any:
    if option.kind == "flag":
        return text.strip().lower() in ("1", "true", "yes", "on")
    return text


def _whole_number(values: dict[str, Any], key: str, minimum: int) -> int:
    flag = "--" + key.replace("_", "-")
    try:
        number = int(values[key])
    except (TypeError, ValueError):
        raise ConfigError(f"{flag} must be a whole number, not {values[key]!r}") from None
    if number < minimum:
        raise ConfigError(f"{flag} must be at least {minimum}")
    return number


def _validate(mountpoint: str, values: dict[str, Any]) -> MountConfig:
    keep_ram = _whole_number(values, "keep_ram", 1)
    persist = values["persist"] or None
    if persist is not None and not str(persist).startswith(("s3://", "file:///")):
        raise ConfigError(f"--persist {persist}: use s3://bucket/prefix or file:///abs/path")
    pattern = str(values["step_pattern"])
    try:
        if re.compile(pattern).groups < 1:
            raise ConfigError(f"--step-pattern {pattern!r} needs a group for the step number")
    except re.error as exc:
        raise ConfigError(
            f"--step-pattern {pattern!r} is not a regular expression: {exc}") from None
    ram_dir = Path(values["ram_dir"]).absolute()
    limit = parse_size(values["ram_limit"])
    if limit <= 0:
        raise ConfigError("--ram-limit must be positive")
    return MountConfig(
        mountpoint=Path(mountpoint).absolute(),
        foreground=bool(values["foreground"]),
        ram_dir=ram_dir,
        ram_limit=limit,
        keep_ram=keep_ram,
        persist=persist,
        persist_every=_whole_number(values, "persist_every", 1),
        keep_persist=_whole_number(values, "keep_persist", 0),
        s3_endpoint=values["s3_endpoint"] or None,
        node_id=str(values["node_id"] or socket.gethostname()),
        step_pattern=pattern,
        log_file=Path(values["log_file"] or ram_dir / "tierfs.log").absolute(),
    )
