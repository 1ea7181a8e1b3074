"""Unit tests of option parsing: sizes, precedence of command line, environment and TOML."""

from __future__ import annotations

import re

import pytest

from tierfs.mount_helper.config import ConfigError, parse_size, resolve
from tierfs.replication.coordination import membership

pytestmark = pytest.mark.core


def test_parse_size() -> None:
    assert parse_size("512M") == 512 << 20
    assert parse_size("64G") == 64 << 30
    assert parse_size("1.5k") == 1536
    assert parse_size("4096") == 4096
    assert parse_size("10GiB") == 10 << 30
    assert parse_size("50%", total_memory=1000) == 500
    for bad in ("lots", "0%", "150%", "12Q"):
        with pytest.raises(ConfigError):
            parse_size(bad)


def test_precedence_command_line_then_environment_then_file(tmp_path) -> None:  # type: ignore[no-untyped-def]
    config = tmp_path / "tierfs.toml"
    config.write_text('ram-limit = "1G"\nkeep-ram = 5\nnode_id = "from-file"\n')
    cfg = resolve("/mnt", {}, {}, str(config))
    assert (cfg.ram_limit, cfg.keep_ram, cfg.node_id) == (1 << 30, 5, "from-file")
    cfg = resolve("/mnt", {}, {"TIERFS_RAM_LIMIT": "2G", "TIERFS_FOREGROUND": "1"}, str(config))
    assert cfg.ram_limit == 2 << 30 and cfg.foreground
    cfg = resolve("/mnt", {"ram_limit": "3G"}, {"TIERFS_RAM_LIMIT": "2G"}, str(config))
    assert cfg.ram_limit == 3 << 30
    assert cfg.log_file == cfg.ram_dir / "tierfs.log"
    assert cfg.ram_dir.as_posix() == "/dev/shm/tierfs"


@pytest.mark.parametrize("cli, message", [
    ({"keep_ram": "x"}, "--keep-ram must be a whole number"),
    ({"step_pattern": "step_[0-9]+"}, "needs a group"),
    ({"step_pattern": "("}, "not a regular expression"),
    ({"ram_limit": "huge"}, "not a size"),
    ({"failure_domain": "rack1"}, "--failure-domain needs --cluster"),
    ({"log_level": "loud"}, "--log-level 'loud': use one of DEBUG, INFO, WARNING, ERROR"),
    ({"failure_domain": "rack 1", "cluster": "etcd://127.0.0.1:2379/x", "insecure": True,
      "listen": "127.0.0.1:7070"}, "use 1 to 63 letters, digits and ._:-"),
])
def test_mistakes_are_one_clear_line(cli, message: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ConfigError, match=message):
        resolve("/mnt", cli, {}, None)


def test_bad_config_file(tmp_path) -> None:  # type: ignore[no-untyped-def]
    config = tmp_path / "c.toml"
    config.write_text("ram-limit = \n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        resolve("/mnt", {}, {}, str(config))
    config.write_text("colour = 'blue'\n")
    with pytest.raises(ConfigError, match="unknown option 'colour'"):
        resolve("/mnt", {}, {}, str(config))
    with pytest.raises(ConfigError, match="cannot read config file"):
        resolve("/mnt", {}, {}, str(tmp_path / "missing.toml"))


@pytest.mark.parametrize("toml, message", [
    ('insecure = "false"', "insecure must be true or false (without quotes), not \"false\""),
    ('foreground = "no"', "foreground must be true or false"),
    ("ram-dir = 5", "ram-dir must be a path in quotes, not 5"),
    ("keep-ram = true", "keep-ram must be a whole number"),
    ("keep-ram = 2.5", "keep-ram must be a whole number"),
    ('ram-limit = ["1G"]', "ram-limit must be a size"),
    ("node-id = 7", "node-id must be a string in quotes"),
])
def test_config_file_values_of_the_wrong_type(tmp_path, toml: str, message: str) -> None:  # type: ignore[no-untyped-def]
    config = tmp_path / "c.toml"
    config.write_text(toml + "\n")
    with pytest.raises(ConfigError, match=re.escape(message)):
        resolve("/mnt", {}, {}, str(config))


def test_config_file_types_that_are_right(tmp_path) -> None:  # type: ignore[no-untyped-def]
    config = tmp_path / "c.toml"
    config.write_text('foreground = false\ninsecure = true\nram-limit = 1048576\n'
                      'ram-dir = "/dev/shm/x"\nkeep-ram = 2\n')
    cfg = resolve("/mnt", {}, {}, str(config))
    assert (cfg.foreground, cfg.ram_limit, str(cfg.ram_dir), cfg.keep_ram) == \
        (False, 1 << 20, "/dev/shm/x", 2)


def test_binary_config_file_and_unknown_flag_words(tmp_path) -> None:  # type: ignore[no-untyped-def]
    config = tmp_path / "c.toml"
    config.write_bytes(bytes(range(256)))
    with pytest.raises(ConfigError, match="is not valid TOML"):
        resolve("/mnt", {}, {}, str(config))
    with pytest.raises(ConfigError, match="TIERFS_FOREGROUND='maybe'"):
        resolve("/mnt", {}, {"TIERFS_FOREGROUND": "maybe"}, None)
    assert not resolve("/mnt", {}, {"TIERFS_FOREGROUND": "off"}, None).foreground


def test_failure_domain_from_the_toml_file(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The DaemonSet writes the node's topology label into a config file of this form."""
    config = tmp_path / "node.toml"
    config.write_text('failure-domain = "us-east-1a"\n')
    cfg = resolve("/mnt", {"cluster": "etcd://127.0.0.1:2379/x", "insecure": True,
                           "listen": "127.0.0.1:7070"}, {}, str(config))
    assert cfg.failure_domain == "us-east-1a"
    assert resolve("/mnt", {}, {}, None).failure_domain is None


@pytest.mark.parametrize("cli, message", [
    ({"ram_limit": "1"}, "--ram-limit 1 is 1 byte: give at least 1M (a size without a unit "
                         "is in bytes"),
    ({"ram_limit": "512K"}, "--ram-limit 512K is 524288 bytes: give at least 1M"),
    ({"ram_limit": "99999999999P"}, "not a size any machine has: '99999999999P'"),
    ({"commit_idle": "1e308"}, "--commit-idle 1e308 is more than a week: give at most 604800 "
                               "seconds"),
    ({"append_every": "1e9"}, "--append-every 1e9 is more than a week"),
    ({"commit_timeout": "inf"}, "--commit-timeout must be a positive number of seconds"),
    ({"lease_ttl": "1"}, "--lease-ttl must be at least 2"),
    ({"lease_ttl": "3600"}, "--lease-ttl 3600 is over 60 seconds"),
    ({"lease_ttl": "2.5"}, "--lease-ttl must be a whole number, not '2.5'"),
])
def test_options_that_cannot_be_right_are_refused(cli: dict[str, str], message: str) -> None:
    """Values no one means (`--ram-limit 1`: one byte, meant as 1G; `--commit-idle 1e308`)
    are refused with one line; sensible ones next to them are taken."""
    with pytest.raises(ConfigError, match=re.escape(message)):
        resolve("/mnt", cli, {}, None)
    resolve("/mnt", {"ram_limit": "1M", "commit_idle": "604800"}, {}, None)
    assert resolve("/mnt", {"lease_ttl": "60"}, {}, None).lease_ttl == 60
    assert resolve("/mnt", {}, {}, None).lease_ttl == membership.DEFAULT_TTL
