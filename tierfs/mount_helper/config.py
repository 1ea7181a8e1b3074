"""Mount configuration: options from the command line, `TIERFS_*` variables and a TOML file.

Precedence is command line, then environment, then `--config` file, then the default. Values are
validated here so that a mistake is one clear line (ConfigError) before anything is mounted.
"""

from __future__ import annotations

import dataclasses
import grp
import hashlib
import os
import pwd
import re
import socket
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tierfs.mount_helper.mounts import real_path
from tierfs.replication.coordination.url import (
    ClusterUrl,
    ClusterUrlError,
    EtcdSecurity,
    parse_cluster_url,
)
from tierfs.replication.peers.tls import PeerTlsFiles
from tierfs.step_names import DEFAULT_FILE_STEP_PATTERN, DEFAULT_STEP_PATTERN


class ConfigError(Exception):
    """A user's configuration mistake; printed as one line."""


@dataclass(frozen=True)
class Option:
    """One mount option. `help` and `default_help` are the one text for `tierfs mount --help`
    and doc/CONFIGURATION.md (generated from this table by `make docs`); backticks mark code
    there and are dropped for --help."""

    name: str
    default: Any
    help: str
    kind: str = "str"  # str, int, float, size, path, flag
    metavar: str = ""
    default_help: str = ""  # the default as a user reads it; "" shows `default` itself

    def shown_default(self) -> str:
        """The default as the docs' table shows it (markdown)."""
        if self.default_help:
            return self.default_help
        if self.kind == "flag":
            return "off"
        if self.default is None:
            return "none"
        value = self.default
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        return f"`{value}`"

    def argparse_help(self) -> str:
        """The --help line: the same text without markdown, `%` escaped for argparse."""
        text = f"{self.help} (default: {self.shown_default()})".replace("`", "")
        return text.replace("%", "%%")


_SEMANTICS = "doc/SEMANTICS.md"
# --lease-ttl: etcd grants no lease much shorter (its default election timeout), and a longer
# one keeps a dead node's files waited for that long. The default is membership.DEFAULT_TTL,
# not imported from there: the command line starts without trio (tests/test_config.py checks
# that the two agree).
DEFAULT_LEASE_TTL, MIN_LEASE_TTL, MAX_LEASE_TTL = 3, 2, 60
MOUNT_OPTIONS = [
    Option("foreground", False, "stay in the foreground, log to stderr", "flag",
           default_help="off: daemonise after the mount is ready"),
    Option("ram-dir", "/dev/shm/tierfs", "where the RAM tier keeps its data; must be on tmpfs "
           "to be RAM", "path", "DIR"),
    Option("ram-limit", "50%", "bytes (`64G`, `512M`) or percent of memory (`50%`) the RAM "
           "tier may hold; at least `1M` (a number without a unit is bytes); a limit above "
           "the RAM dir's file system's size or the host's memory mounts with a warning", "size",
           "SIZE"),
    Option("keep-ram", 3, "committed steps kept in RAM per run directory; a copy of an older "
           "one leaves RAM only once the persistent tier holds it, or K+1 other live nodes do: "
           "without `--persist` a cluster keeps its K+1 copies of every file in RAM; kept ones "
           f"leave too when a write needs the room (see \"RAM limit\" in {_SEMANTICS})", "int",
           "N"),
    Option("persist", None, "persistent tier: `s3://bucket/prefix` or `file:///abs/path`",
           metavar="URL", default_help="none: RAM only, with a warning"),
    Option("persist-every", 1, "persist every N-th step (by step number); `1` = every step",
           "int", "N"),
    Option("keep-persist", 0, "committed steps kept in the persistent tier per run directory; "
           "`0` = keep all", "int", "N"),
    Option("s3-endpoint", None, "S3-compatible endpoint (also `AWS_ENDPOINT_URL`); path-style "
           "addressing when set", metavar="URL", default_help="AWS"),
    Option("node-id", None, "this node's name", metavar="ID", default_help="the host name"),
    Option("cluster", None, "join the cluster whose membership and commit records live in "
           "these etcd endpoints under PREFIX: `etcd://HOST:PORT[,HOST:PORT...]/PREFIX` "
           "(`etcds://` for TLS; see "
           "doc/CLUSTER.md)", metavar="URL", default_help="none: single node"),
    Option("etcd-cacert", None, "with `--cluster`: the CA certificate etcd's server "
           "certificate is checked against, as etcdctl's `--cacert` (implies TLS, as "
           "`etcds://` does)", "path", "FILE", default_help="plain http"),
    Option("etcd-cert", None, "with `--cluster`: this node's client certificate for etcd, as "
           "etcdctl's `--cert` (implies TLS; with etcd's auth on, one without a CommonName: "
           "etcd's JSON gateway refuses those)", "path", "FILE"),
    Option("etcd-key", None, "with `--cluster`: the private key of `--etcd-cert`, as "
           "etcdctl's `--key`", "path", "FILE"),
    Option("etcd-user", None, "with `--cluster`: the etcd user, when etcd has auth enabled; "
           "its password comes from `--etcd-password-file` or `TIERFS_ETCD_PASSWORD`, never "
           "the command line", metavar="NAME", default_help="no auth"),
    Option("etcd-password-file", None, "file holding `--etcd-user`'s password; must not be "
           "readable by others", "path", "FILE"),
    Option("listen", None, "this node's peer data port, HOST:PORT (required with `--cluster`)",
           metavar="HOST:PORT"),
    Option("advertise", None, "the address peers connect to, when not `--listen`'s (required "
           "when `--listen` is `0.0.0.0` or `::`)", metavar="HOST:PORT",
           default_help="`--listen`"),
    Option("failure-domain", None, "with `--cluster`: this node's failure domain (a rack, a "
           "switch, a zone: what fails together), letters, digits and `._:-`; a file's "
           "copies go to nodes of other domains than its writer's first, each copy to another "
           "domain while there are some (see doc/CLUSTER.md)", metavar="NAME",
           default_help="none: every node its own"),
    Option("replicas", None, "extra copies of each committed file on other nodes (see "
           "doc/CLUSTER.md); needs `--cluster`", "int", "K", default_help="`1` in a cluster"),
    Option("token-file", None, "file holding the shared secret (at least 16 bytes) peer data "
           "connections must prove; required with `--cluster` unless `--insecure`; refused if "
           "others can read it", "path", "FILE"),
    Option("insecure", False, "allow `--cluster` without a token, on a closed, trusted network "
           "only", "flag"),
    Option("peer-tls", False, "with `--cluster`: peer data in mutual TLS (1.3), each node with "
           "a certificate of the cluster's CA (`--peer-cacert`, `--peer-cert`, `--peer-key`); "
           "the token handshake and every frame's MAC stay. Every node of a cluster runs with "
           "it or without it (its first node sets which): a node mounted the other way, or "
           "whose certificate a live member refuses, is refused at mount (see doc/CLUSTER.md)",
           "flag", default_help="off: peer data in clear, every frame MAC'd"),
    Option("peer-connections", 4, "with `--cluster`: connections a node uses at once to move "
           "files to or from one peer (replicas, restores); each carries its share of the "
           "chunks in a worker thread of its own, so one transfer can use that many cores",
           "int", "N"),
    Option("peer-cacert", None, "with `--peer-tls`: the cluster's CA certificate, which every "
           "peer's certificate must be signed by", "path", "FILE"),
    Option("peer-cert", None, "with `--peer-tls`: this node's certificate, signed by the "
           "cluster's CA (no host name is checked: peers are reached by address, the token "
           "handshake says which node it is)", "path", "FILE"),
    Option("peer-key", None, "with `--peer-tls`: the private key of `--peer-cert`; refused if "
           "others can read it", "path", "FILE"),
    Option("peers", None, "removed: given, it is refused with one line naming `--cluster` and "
           "`--listen`", metavar="LIST"),
    Option("step-pattern", DEFAULT_STEP_PATTERN, "which directory names are steps (a regular "
           "expression); group 1 is the step number", metavar="REGEX"),
    Option("file-step-pattern", DEFAULT_FILE_STEP_PATTERN, "which names of files outside step "
           "directories are file steps (single-file checkpoints; a regular expression); group "
           "1 is the step number", metavar="REGEX",
           default_help="the number before a checkpoint extension: `epoch=0-step=5.ckpt`, "
           f"`model_1000.pt` (see \"File steps and loose files\" in {_SEMANTICS})"),
    Option("commit-idle", 5.0, "a step being written commits by itself once no file of it has "
           "been open for writing or changed for this long (at most a week)", "float", "SECONDS"),
    Option("append-every", 60.0, "a loose file (outside step directories, no step number: a "
           "log, a TensorBoard event file) that is still being appended commits what it holds "
           "every this many seconds, so that the store and the peers have it at most this "
           "stale; the store gets only the appended bytes (see \"Appended files\" in "
           f"{_SEMANTICS}); `0`: off, such a file commits only once quiet; at most a week", "float",
           "SECONDS"),
    Option("commit-timeout", 20.0, "with `--cluster`: the longest a saver's call that commits a "
           "step (the close or rename of DCP's `.metadata`) waits for etcd, in all; then it "
           "fails with `ETIMEDOUT` (the save raises), and the step stays `writing` and commits "
           "by itself once etcd answers (see doc/CLUSTER.md); at most a week", "float", "SECONDS"),
    Option("lease-ttl", DEFAULT_LEASE_TTL, "with `--cluster`: seconds this node's etcd lease lives "
           "without a keepalive (one is sent every third of it): how soon after a node dies or "
           "loses etcd the others count it gone, and how long reads wait for a holder that "
           "does not answer while its lease lives (a daemon restarting on its RAM dir serves "
           "them if it is back within it). Longer rides out stalls of a loaded machine, "
           f"shorter finds a loss sooner; {MIN_LEASE_TTL} to {MAX_LEASE_TTL}; give every node "
           "the same", "int", "SECONDS"),
    Option("sync-replicas", False, "with `--cluster`: the saver's call that commits a step (the "
           "close or rename of DCP's `.metadata`) returns only once every file of the step has "
           "K+1 verified copies on live nodes (as many as there are live nodes, if fewer), "
           "waiting at most `--commit-timeout` more, then failing with `ETIMEDOUT` (the step "
           "stays committed; its copies go on)", "flag",
           default_help="off: it returns at the commit, and the copies follow within seconds "
           "(the window between save and copies)"),
    Option("no-passthrough", False, "route file data through the daemon even where the kernel "
           "could pass reads and writes straight to the RAM store (slower; for comparison)",
           "flag", default_help="off: passthrough when available"),
    Option("metrics", None, "serve Prometheus metrics at `http://HOST:PORT/metrics` (e.g. "
           "`127.0.0.1:9100`; `:9100` listens on every interface; see \"Metrics\" in "
           "doc/DEPLOYMENT.md)", metavar="HOST:PORT"),
    Option("log-file", None, "log destination when daemonised", "path", "FILE",
           default_help="`<ram-dir>/tierfs.log`"),
    Option("log-level", "INFO", "the lowest level of the daemon's own records that reach the "
           "log: `DEBUG` adds, e.g., which step `latest` names for each process and why (the "
           "libraries' records stay at `INFO`)", metavar="LEVEL"),
    Option("allow-non-empty", False, "mount on a directory that is not empty (its content stays "
           "hidden while tierfs is mounted)", "flag", default_help="off: refused"),
    Option("allow-other", False, "other users may use the mount (FUSE `allow_other`); the "
           "kernel still enforces file modes, and they may run `tierfs status`/`flush`", "flag"),
    Option("uid", None, "owner of the mount's root directory, a user name or number; only the "
           "root: files keep the owner of whoever creates them", metavar="USER",
           default_help="unchanged (first: the daemon's user)"),
    Option("gid", None, "group of the mount's root directory, a name or number",
           metavar="GROUP", default_help="the `--uid` user's group, else unchanged"),
    Option("root-mode", None, "mode of the mount's root directory, octal (`1777` for a shared, "
           "sticky root)", metavar="MODE", default_help="unchanged (first `755`)"),
]

# What a TOML value of each kind must be, and how to say so.
_TOML_KINDS: dict[str, tuple[tuple[type, ...], str]] = {
    "flag": ((bool,), "true or false (without quotes)"),
    "int": ((int,), "a whole number (without quotes)"),
    "float": ((int, float), "a number (without quotes)"),
    "size": ((str, int), 'a size in quotes ("64G", "50%") or a number of bytes'),
    "path": ((str,), "a path in quotes"),
    "str": ((str,), "a string in quotes"),
}
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off", "")


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
    cluster: ClusterUrl | None
    listen: tuple[str, int] | None
    advertise: str | None  # HOST:PORT peers connect to (--advertise, else --listen)
    replicas: int
    token: bytes | None
    node_id: str
    step_pattern: str
    log_file: Path
    file_step_pattern: str = DEFAULT_FILE_STEP_PATTERN
    passthrough: bool = True
    allow_non_empty: bool = False
    commit_idle: float = 5.0
    append_every: float = 60.0
    commit_timeout: float = 20.0
    sync_replicas: bool = False
    allow_other: bool = False
    root_uid: int | None = None
    root_gid: int | None = None
    root_mode: int | None = None
    metrics: tuple[str, int] | None = None
    peer_tls: PeerTlsFiles | None = None  # --peer-tls
    failure_domain: str | None = None  # --failure-domain
    peer_connections: int = 4  # --peer-connections
    lease_ttl: int = DEFAULT_LEASE_TTL  # --lease-ttl
    log_level: str = "INFO"  # --log-level

    @property
    def control_socket(self) -> str:
        """A file in the private RAM dir; with --allow-other an abstract socket ("@" name)
        instead, which every local user can reach (the daemon checks who asks)."""
        if self.allow_other:
            return abstract_socket_name(self.ram_dir)
        return str(self.ram_dir / "control.sock")


ABSTRACT_PREFIX = "@tierfs-control:"
SOCKET_NAME_MAX = 107  # sun_path holds 108 bytes; an abstract name starts with a NUL


def abstract_socket_name(ram_dir: Path) -> str:
    """Named after the RAM dir (one daemon holds it at a time), so that a stuck daemon can be
    described; hashed when the path is too long for a socket name."""
    name = ABSTRACT_PREFIX + str(ram_dir)
    if len(os.fsencode(name)) <= SOCKET_NAME_MAX:
        return name
    return ABSTRACT_PREFIX + "#" + hashlib.sha256(os.fsencode(ram_dir)).hexdigest()[:32]


_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([kmgtp]?)i?b?\s*$", re.IGNORECASE)
# A RAM tier smaller than this holds no checkpoint: `--ram-limit 1` is one byte, most likely
# meant as 1G. Sizes from 2**63 on fit no file system's counters (statfs, df).
MIN_RAM_LIMIT = 1 << 20
MAX_SIZE = (1 << 63) - 1
# The longest a duration option may be: none of them means anything beyond a week (a step that
# commits by itself a week after its last change), and a value like 1e308 overflows the
# timers it sets.
MAX_SECONDS = 7 * 24 * 3600.0


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
    size = int(float(number) * 1024 ** "bkmgtp".index(unit.lower() or "b"))
    if size > MAX_SIZE:
        raise ConfigError(f"not a size any machine has: {text!r}")
    return size


def parse_address(text: str, option: str) -> tuple[str, int]:
    """'127.0.0.1:9100', '[::1]:9100' or ':9100' (every interface) -> (host, port)."""
    host, colon, port = str(text).strip().rpartition(":")
    if not colon or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"{option} {text!r} is not HOST:PORT (e.g. 127.0.0.1:9100)")
    return host.strip("[]") or "0.0.0.0", int(port)


def read_secret(path: str | Path, what: str) -> bytes:
    """The content of a secret's file (stripped); refused if others may read it."""
    try:
        st = os.stat(path)
        with open(path, "rb") as f:
            secret = f.read().strip()
    except OSError as exc:
        raise ConfigError(f"cannot read {what} {path}: {exc.strerror}") from None
    if st.st_mode & 0o077:
        raise ConfigError(f"{what} {path} is readable by others (mode "
                          f"{st.st_mode & 0o777:o}): chmod 600 it")
    return secret


def read_token(path: str | Path) -> bytes:
    """The cluster secret; refused if others may read it."""
    token = read_secret(path, "token file")
    if len(token) < 16:
        raise ConfigError(f"token file {path} holds fewer than 16 bytes: use a long secret")
    return token


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
        except UnicodeDecodeError:
            raise ConfigError(f"config file {config_file} is not valid TOML: it is not UTF-8 "
                              "text") from None
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
                value = _from_file(option, file_values.get(option.name, file_values.get(key)),
                                   str(config_file))
            else:
                value = option.default
        values[key] = value
    return _validate(mountpoint, values)


def _from_env(option: Option, text: str) -> Any:
    if option.kind != "flag":
        return text
    word = text.strip().lower()
    if word not in _TRUE + _FALSE:
        raise ConfigError(f"TIERFS_{option.name.replace('-', '_').upper()}={text!r}: use "
                          "1, true, yes or on, or 0, false, no or off")
    return word in _TRUE


def _from_file(option: Option, value: Any, config_file: str) -> Any:
    """A TOML value of the option's type (a quoted "false" is a string, not false)."""
    types, expected = _TOML_KINDS[option.kind]
    if isinstance(value, bool) and bool not in types or not isinstance(value, types):
        shown = f'"{value}"' if isinstance(value, str) else repr(value)
        raise ConfigError(f"config file {config_file}: {option.name} must be {expected}, "
                          f"not {shown}")
    return value


def _whole_number(values: dict[str, Any], key: str, minimum: int) -> int:
    flag = "--" + key.replace("_", "-")
    try:
        number = int(values[key])
    except (TypeError, ValueError):
        raise ConfigError(f"{flag} must be a whole number, not {values[key]!r}") from None
    if number < minimum:
        raise ConfigError(f"{flag} must be at least {minimum}")
    return number


def _seconds(values: dict[str, Any], key: str) -> float:
    flag = "--" + key.replace("_", "-")
    try:
        seconds = float(values[key])
    except (TypeError, ValueError):
        raise ConfigError(f"{flag} must be a number of seconds, not {values[key]!r}") from None
    if not 0 < seconds < float("inf"):
        raise ConfigError(f"{flag} must be a positive number of seconds")
    if seconds > MAX_SECONDS:
        raise ConfigError(f"{flag} {values[key]} is more than a week: give at most "
                          f"{MAX_SECONDS:.0f} seconds")
    return seconds


def _step_pattern(values: dict[str, Any], key: str) -> str:
    """A step pattern option: a regular expression whose group 1 is the step number."""
    pattern = str(values[key])
    option = "--" + key.replace("_", "-")
    try:
        if re.compile(pattern).groups < 1:
            raise ConfigError(f"{option} {pattern!r} needs a group for the step number")
    except re.error as exc:
        raise ConfigError(f"{option} {pattern!r} is not a regular expression: {exc}") from None
    return pattern


def _validate(mountpoint: str, values: dict[str, Any]) -> MountConfig:
    keep_ram = _whole_number(values, "keep_ram", 1)
    persist = values["persist"] or None
    if persist is not None and not str(persist).startswith(("s3://", "file:///")):
        raise ConfigError(f"--persist {persist}: use s3://bucket/prefix or file:///abs/path")
    pattern = _step_pattern(values, "step_pattern")
    file_pattern = _step_pattern(values, "file_step_pattern")
    node_id = str(values["node_id"] or socket.gethostname())
    if values["peers"]:
        raise ConfigError("--peers is gone: name the cluster's etcd with --cluster "
                          "etcd://HOST:PORT/PREFIX and this node's peer port with --listen")
    cluster, listen, advertise = _cluster(values, node_id)
    replicas = _whole_number(values, "replicas", 0) if values["replicas"] is not None else (
        1 if cluster else 0)
    if replicas and cluster is None:
        raise ConfigError(f"--replicas {replicas} needs --cluster")
    if values["sync_replicas"] and cluster is None:
        raise ConfigError("--sync-replicas needs --cluster")
    domain = _failure_domain(values["failure_domain"], cluster is not None)
    token = read_token(values["token_file"]) if values["token_file"] else None
    if cluster and token is None:
        if not values["insecure"]:
            raise ConfigError("--cluster needs --token-file (or --insecure on a trusted "
                              "network)")
        token = b"insecure"
    ram_dir = Path(values["ram_dir"]).absolute()
    limit = parse_size(values["ram_limit"])
    if limit < MIN_RAM_LIMIT:
        raise ConfigError(f"--ram-limit {values['ram_limit']} is {limit} "
                          f"byte{'' if limit == 1 else 's'}: give at least 1M (a size without "
                          "a unit is in bytes: 64G, 512M, or 50% of memory)")
    return MountConfig(
        # The real path: a symlink to a mounted directory must be seen as that mount.
        mountpoint=Path(real_path(mountpoint)),
        foreground=bool(values["foreground"]),
        ram_dir=ram_dir,
        ram_limit=limit,
        keep_ram=keep_ram,
        persist=persist,
        persist_every=_whole_number(values, "persist_every", 1),
        keep_persist=_whole_number(values, "keep_persist", 0),
        s3_endpoint=values["s3_endpoint"] or None,
        cluster=cluster,
        listen=listen,
        advertise=advertise,
        replicas=replicas,
        token=token,
        node_id=node_id,
        step_pattern=pattern,
        file_step_pattern=file_pattern,
        log_file=Path(values["log_file"] or ram_dir / "tierfs.log").absolute(),
        passthrough=not values["no_passthrough"],
        allow_non_empty=bool(values["allow_non_empty"]),
        commit_idle=_seconds(values, "commit_idle"),
        append_every=0.0 if str(values["append_every"]) in ("0", "0.0") else _seconds(
            values, "append_every"),
        commit_timeout=_seconds(values, "commit_timeout"),
        sync_replicas=bool(values["sync_replicas"]),
        allow_other=bool(values["allow_other"]),
        metrics=parse_address(values["metrics"], "--metrics") if values["metrics"] else None,
        peer_tls=_peer_tls(values),
        failure_domain=domain,
        peer_connections=_whole_number(values, "peer_connections", 1),
        lease_ttl=_lease_ttl(values),
        log_level=_log_level(values["log_level"]),
        **_root_directory(values),
    )


def _lease_ttl(values: dict[str, Any]) -> int:
    ttl = _whole_number(values, "lease_ttl", MIN_LEASE_TTL)
    if ttl > MAX_LEASE_TTL:
        raise ConfigError(f"--lease-ttl {ttl} is over {MAX_LEASE_TTL} seconds: a dead node "
                          "would hold its files' reads that long")
    return ttl


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def _log_level(value: Any) -> str:
    level = str(value).upper()
    if level not in LOG_LEVELS:
        raise ConfigError(f"--log-level {value!r}: use one of {', '.join(LOG_LEVELS)}")
    return level


_DOMAIN = re.compile(r"^[A-Za-z0-9._:-]{1,63}$")


def _failure_domain(value: Any, cluster: bool) -> str | None:
    if value is None or value == "":
        return None
    if not cluster:
        raise ConfigError("--failure-domain needs --cluster")
    if not _DOMAIN.match(str(value)):
        raise ConfigError(f"--failure-domain {value!r}: use 1 to 63 letters, digits and ._:-")
    return str(value)


def _cluster(values: dict[str, Any], node_id: str
             ) -> tuple[ClusterUrl | None, tuple[str, int] | None, str | None]:
    """--cluster, --listen and --advertise: (etcd and prefix, where to listen, the address
    peers use); all None on a single node."""
    if not values["cluster"]:
        for option in ("listen", "advertise", *ETCD_OPTIONS, "peer_tls"):
            if values[option]:
                raise ConfigError(f"--{option.replace('_', '-')} needs --cluster")
        return None, None, None
    try:
        cluster = parse_cluster_url(str(values["cluster"]))
    except ClusterUrlError as exc:
        raise ConfigError(str(exc)) from None
    cluster = dataclasses.replace(cluster, security=_etcd_security(values, cluster.security.tls))
    if "/" in node_id:
        raise ConfigError(f"--node-id {node_id!r} must not contain '/'")
    if not values["listen"]:
        raise ConfigError("--cluster needs --listen HOST:PORT (this node's peer data port)")
    listen = parse_address(values["listen"], "--listen")
    if values["advertise"]:
        host, port = parse_address(values["advertise"], "--advertise")
    else:
        host, port = listen
        if host in ("0.0.0.0", "::"):
            raise ConfigError(f"--listen {values['listen']} listens on every interface: "
                              "say with --advertise HOST:PORT which address peers use")
    return cluster, listen, f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


ETCD_OPTIONS = ("etcd_cacert", "etcd_cert", "etcd_key", "etcd_user", "etcd_password_file")


def _etcd_security(values: dict[str, Any], tls: bool) -> EtcdSecurity:
    """--etcd-cacert, --etcd-cert, --etcd-key (any of them means TLS) and --etcd-user with
    its password (from a file others cannot read, or TIERFS_ETCD_PASSWORD)."""
    files = {}
    for name in ("etcd_cacert", "etcd_cert", "etcd_key"):
        if values[name]:
            path = Path(values[name]).absolute()
            if not path.is_file():
                raise ConfigError(f"--{name.replace('_', '-')} {values[name]}: no such file")
            files[name] = str(path)
    if bool(values["etcd_cert"]) != bool(values["etcd_key"]):
        raise ConfigError("--etcd-cert and --etcd-key go together")
    password = None
    if values["etcd_password_file"] and not values["etcd_user"]:
        raise ConfigError("--etcd-password-file needs --etcd-user")
    if values["etcd_password_file"]:
        password = read_secret(values["etcd_password_file"], "password file").decode()
    elif values["etcd_user"]:
        password = os.environ.get("TIERFS_ETCD_PASSWORD")
        if password is None:
            raise ConfigError("--etcd-user needs --etcd-password-file (or the environment "
                              "variable TIERFS_ETCD_PASSWORD)")
    return EtcdSecurity(tls=tls or bool(files), cacert=files.get("etcd_cacert"),
                        cert=files.get("etcd_cert"), key=files.get("etcd_key"),
                        user=values["etcd_user"] or None, password=password)


PEER_TLS_FILES = ("peer_cacert", "peer_cert", "peer_key")


def _peer_tls(values: dict[str, Any]) -> PeerTlsFiles | None:
    """--peer-tls and its three files (each required with it, none without it)."""
    if not values["peer_tls"]:
        for name in PEER_TLS_FILES:
            if values[name]:
                raise ConfigError(f"--{name.replace('_', '-')} needs --peer-tls")
        return None
    files = {}
    for name in PEER_TLS_FILES:
        flag = "--" + name.replace("_", "-")
        if not values[name]:
            raise ConfigError(f"--peer-tls needs {flag} FILE (and --peer-cacert, --peer-cert, "
                              "--peer-key together)")
        path = Path(values[name]).absolute()
        if not path.is_file():
            raise ConfigError(f"{flag} {values[name]}: no such file")
        files[name] = str(path)
    if os.stat(files["peer_key"]).st_mode & 0o077:
        raise ConfigError(f"--peer-key {values['peer_key']} is readable by others: chmod 600 it")
    return PeerTlsFiles(files["peer_cacert"], files["peer_cert"], files["peer_key"])


def _root_directory(values: dict[str, Any]) -> dict[str, int | None]:
    """--uid, --gid and --root-mode as numbers; --gid defaults to the --uid user's group."""
    uid = gid = mode = None
    if values["uid"] is not None:
        uid, primary_gid = _user(str(values["uid"]))
        gid = primary_gid
    if values["gid"] is not None:
        gid = _group(str(values["gid"]))
    if values["root_mode"] is not None:
        text = str(values["root_mode"]).strip()
        try:
            mode = int(text, 8)
        except ValueError:
            raise ConfigError(f"--root-mode {text!r} is not an octal mode (e.g. 755)") from None
        if not 0 <= mode <= 0o7777:
            raise ConfigError(f"--root-mode {text!r} is out of range (0 to 7777)")
    return {"root_uid": uid, "root_gid": gid, "root_mode": mode}


def _user(text: str) -> tuple[int, int | None]:
    """(uid, primary gid) of a user name or number (a number need not be a known user: then
    the group is left as it is)."""
    try:
        entry = pwd.getpwnam(text) if not text.isdigit() else pwd.getpwuid(int(text))
    except KeyError:
        if text.isdigit():
            return int(text), None
        raise ConfigError(f"--uid {text}: no such user") from None
    return entry.pw_uid, entry.pw_gid


def _group(text: str) -> int:
    if text.isdigit():
        return int(text)
    try:
        return grp.getgrnam(text).gr_gid
    except KeyError:
        raise ConfigError(f"--gid {text}: no such group") from None
