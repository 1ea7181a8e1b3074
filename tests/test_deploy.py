"""The service files in deploy/: the systemd units' key settings (read with configparser) and
`systemd-analyze verify` (installed by the Makefile), the Kubernetes YAML has what a FUSE
daemon needs there and names the image `make image` builds (tests/test_image.py runs it as the
YAML says), and the Slurm scripts are valid shell. Every tierfs command line in them
is parsed by tierfs's own argument parser, so an option they use cannot drift away."""

from __future__ import annotations

import configparser
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.daemonset_pod import made_image_name
from tierfs.mount_helper.cli import build_parser
from tierfs.mount_helper.config import resolve

pytestmark = pytest.mark.core

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
INSTALLED = "/opt/tierfs/.venv/bin/tierfs"
# Options of the cluster issue (CONTRACT.md) that a tree without them yet does not parse.
FUTURE_OPTIONS = ("--cluster", "--listen")


def _unit(name: str) -> configparser.ConfigParser:
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.optionxform = str  # type: ignore[assignment,method-assign]  # keys are case-sensitive
    parser.read(DEPLOY / "systemd" / name)
    return parser


def _exec_lines(name: str, key: str) -> list[str]:
    """Every `key=` line of a unit (repeated keys), continuation lines joined."""
    text = (DEPLOY / "systemd" / name).read_text().replace("\\\n", " ")
    return [line.split("=", 1)[1] for line in text.splitlines() if line.startswith(key + "=")]


def _parses(argv: list[str]) -> None:
    """tierfs's parser accepts `argv` (minus options of issues not merged yet, with values)."""
    kept: list[str] = []
    items = iter(argv)
    for item in items:
        if item in FUTURE_OPTIONS and not _known(item):
            next(items)
        else:
            kept.append(item)
    build_parser().parse_args(kept)


def _known(option: str) -> bool:
    """`tierfs mount` has `option` (taking a value)."""
    try:
        build_parser().parse_args(["mount", "/m", option, "x"])
    except SystemExit:
        return False
    return True


def test_systemd_unit_orders_mount_before_training_and_flushes_on_stop(
        tmp_path: Path) -> None:
    unit = _unit("tierfs.service")
    assert "training.service" in unit["Unit"]["Before"]
    assert unit["Service"]["Type"] == "simple"
    start = shlex.split(_exec_lines("tierfs.service", "ExecStart")[0])
    assert start[:3] == [INSTALLED, "mount", "/checkpoints"] and "--foreground" in start
    assert "--allow-other" in start
    _parses(start[1:])
    # one command: the quiet steps commit, the flush (bounded), then the unmount whatever
    # the flush left (a flush before a separate umount left the last step uncommitted)
    (stop,) = [shlex.split(line.lstrip("-")) for line in _exec_lines("tierfs.service",
                                                                      "ExecStop")]
    assert stop[1:3] == ["umount", "/checkpoints"]
    assert {"--flush", "--timeout", "--force"} <= set(stop)
    _parses(stop[1:])
    flush_timeout = float(stop[stop.index("--timeout") + 1])
    assert int(unit["Service"]["TimeoutStopSec"]) > flush_timeout
    training = _unit("training.service")
    assert "tierfs.service" in training["Unit"]["After"]
    assert "tierfs.service" in training["Unit"]["Requires"]
    # systemd-analyze comes with the Makefile's Debian packages: its absence is a failure.
    assert shutil.which("systemd-analyze"), "systemd-analyze missing: run `make install`"
    # verify checks that the programs exist: point the units at this tree's tierfs
    for name in ("tierfs.service", "training.service"):
        text = (DEPLOY / "systemd" / name).read_text()
        text = text.replace(INSTALLED, str(Path(sys.executable).parent / "tierfs"))
        text = text.replace("/usr/bin/python3 /opt/train/train.py", "/bin/true")
        (tmp_path / name).write_text(text)
    done = subprocess.run(["systemd-analyze", "verify", "tierfs.service", "training.service"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and not done.stderr.strip(), done.stderr


def _load(name: str) -> dict[str, Any]:
    (document,) = yaml.safe_load_all((DEPLOY / "kubernetes" / name).read_text())
    return document


def _by_name(items: list[dict[str, Any]], name: str) -> dict[str, Any]:
    return next(item for item in items if item["name"] == name)


def test_daemonset_has_what_a_fuse_daemon_needs() -> None:
    ds = _load("tierfs-daemonset.yaml")
    assert ds["kind"] == "DaemonSet" and ds["apiVersion"] == "apps/v1"
    pod = ds["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["image"] == made_image_name()  # what `make image` builds
    assert container["securityContext"]["privileged"] is True
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    assert volumes[mounts["/dev/fuse"]["name"]]["hostPath"]["path"] == "/dev/fuse"
    assert volumes[mounts["/dev/shm"]["name"]]["hostPath"]["path"] == "/dev/shm"
    checkpoints = mounts["/checkpoints"]
    assert checkpoints["mountPropagation"] == "Bidirectional"
    assert volumes[checkpoints["name"]]["hostPath"]["path"] == "/checkpoints"
    command = container["command"]
    assert command[:4] == ["tierfs", "mount", "/checkpoints", "--foreground"]
    assert command[command.index("--ram-dir") + 1].startswith("/dev/shm/")
    assert command[command.index("--cluster") + 1].startswith("etcd://$(ETCD_ENDPOINTS)")
    assert "--listen" in command
    _parses(command[1:])
    env = {e["name"]: e for e in container["env"]}
    assert env["ETCD_ENDPOINTS"]["valueFrom"]["secretKeyRef"]["name"] == "tierfs"
    token_path = command[command.index("--token-file") + 1]
    token_mount = next(m for m in mounts.values() if token_path.startswith(m["mountPath"]))
    token_volume = volumes[token_mount["name"]]["secret"]
    assert token_volume["secretName"] == "tierfs" and token_volume["defaultMode"] & 0o077 == 0
    pre_stop = container["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[:3] == ["tierfs", "flush", "/checkpoints"]
    _parses(pre_stop[1:])
    flush_timeout = float(pre_stop[pre_stop.index("--timeout") + 1])
    assert pod["terminationGracePeriodSeconds"] > flush_timeout


def test_daemonset_gives_each_node_its_failure_domain(tmp_path: Path) -> None:
    """The init container writes the node's topology label as a TOML config file that the
    daemon reads (--config); its ServiceAccount may read nodes, and nothing more."""
    pod = _load("tierfs-daemonset.yaml")["spec"]["template"]["spec"]
    (init,) = pod["initContainers"]
    script = init["command"][-1]
    assert "kubectl get node" in script and "topology\\.kubernetes\\.io/zone" in script
    written = script.rsplit(">", 1)[1].strip()
    command = pod["containers"][0]["command"]
    assert command[command.index("--config") + 1] == written
    shared = {m["name"] for m in init["volumeMounts"]} & {
        m["name"] for m in pod["containers"][0]["volumeMounts"]}
    assert shared and "emptyDir" in _by_name(pod["volumes"], shared.pop())
    # run the script with a kubectl that prints the label: what it writes, tierfs takes
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "kubectl").write_text("#!/bin/sh\nprintf us-east-1a\n")
    (bin_dir / "kubectl").chmod(0o755)
    mount_dir = next(m["mountPath"] for m in init["volumeMounts"])
    subprocess.run(["sh", "-c", script.replace(mount_dir, str(tmp_path))], check=True,
                   env={"PATH": f"{bin_dir}:/usr/bin:/bin", "NODE_NAME": "gpu-7"})
    config = tmp_path / Path(written).name
    cfg = resolve("/mnt", {"cluster": "etcd://127.0.0.1:2379/x", "insecure": True,
                           "listen": "127.0.0.1:7070"}, {}, str(config))
    assert cfg.failure_domain == "us-east-1a"
    rbac = list(yaml.safe_load_all((DEPLOY / "kubernetes" / "tierfs-rbac.yaml").read_text()))
    kinds = {doc["kind"]: doc for doc in rbac}
    assert kinds["ServiceAccount"]["metadata"]["name"] == pod["serviceAccountName"]
    assert kinds["ClusterRole"]["rules"] == [{"apiGroups": [""], "resources": ["nodes"],
                                              "verbs": ["get"]}]
    assert kinds["ClusterRoleBinding"]["subjects"][0]["name"] == pod["serviceAccountName"]


def test_training_pod_sees_the_mount() -> None:
    pod = _load("training-pod.yaml")
    assert pod["kind"] == "Pod"
    (container,) = pod["spec"]["containers"]
    mount = _by_name(container["volumeMounts"], "checkpoints")
    assert mount["mountPath"] == "/checkpoints"
    assert mount["mountPropagation"] == "HostToContainer"
    volume = _by_name(pod["spec"]["volumes"], "checkpoints")
    assert volume["hostPath"]["path"] == "/checkpoints"
    daemon = _load("tierfs-daemonset.yaml")["spec"]["template"]["spec"]["containers"][0]
    uid = daemon["command"][daemon["command"].index("--uid") + 1]
    assert str(pod["spec"]["securityContext"]["runAsUser"]) == uid


@pytest.mark.parametrize("script", ["prolog.sh", "epilog.sh"])
def test_slurm_scripts_are_valid_shell(script: str) -> None:
    path = DEPLOY / "slurm" / script
    done = subprocess.run(["sh", "-n", str(path)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert path.stat().st_mode & 0o111


def test_slurm_epilog_commits_flushes_and_unmounts_in_one_command() -> None:
    """After the job its last steps commit first (`umount` settles them), then the bounded
    flush, then the unmount: a `flush` before a separate `umount` left the last step
    uncommitted, so in no store."""
    lines = [line.strip() for line in (DEPLOY / "slurm/epilog.sh").read_text().splitlines()
             if line.strip().startswith('"$TIERFS"')]
    assert len(lines) == 1, lines
    argv = shlex.split(lines[0])[1:]
    assert argv[:2] == ["umount", "/checkpoints"]
    assert {"--flush", "--timeout", "--force"} <= set(argv)
    _parses(argv)
