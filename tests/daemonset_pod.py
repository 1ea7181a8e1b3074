"""The pod of deploy/kubernetes/tierfs-daemonset.yaml run with podman, as a kubelet runs it on
a node: the manifest's image command, privileges, host network, environment and volumes
(hostPath volumes bind-mounted with the manifest's mount propagation, the Secret's items as
files with its modes, emptyDir volumes as fresh directories), its init containers first (in
the tierfs image: no registry here, with a `kubectl` that answers for the node's labels as the
API server would), all read from the manifest, so that the image is tested with the options
deploy/ ships. The test gives what differs from site to site: the node's name and address, the
Secret's values, the host directories behind the hostPath volumes, and new values for some
options of the command (a RAM dir and a peer port of its own).

    pod = DaemonSetPod(site, work_dir)
    pod.start()            # podman run -d ...
    pod.exec("tierfs", "status", "/checkpoints")
    pod.stop()             # preStop's command, then SIGTERM
    pod.remove()           # podman rm -f, also after a failure

podman reads deploy/container/containers.conf (as `make image` does), never a configuration
of the machine's own."""

from __future__ import annotations

import os
import re
import stat
import subprocess
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
MANIFEST = ROOT / "deploy" / "kubernetes" / "tierfs-daemonset.yaml"
CONTAINERS_CONF = ROOT / "deploy" / "container" / "containers.conf"
# Kubernetes' mountPropagation as a bind mount's propagation (None: private, its default).
PROPAGATION = {"Bidirectional": "rshared", "HostToContainer": "rslave", "None": "rprivate"}
VARIABLE = re.compile(r"\$\((\w+)\)")  # $(NAME) in a command: the container's variable


def podman(*args: str, check: bool = True,
           timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """podman with the project's containers.conf; `check`: fail with its error output."""
    done = subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, CONTAINERS_CONF=str(CONTAINERS_CONF)))
    if check and done.returncode != 0:
        raise AssertionError(f"podman {' '.join(args)} failed ({done.returncode}): "
                             f"{done.stderr.strip()}")
    return done


def image_name() -> str:
    """The image to test: TIERFS_IMAGE (`make test-image` sets it), else `make image`'s."""
    return os.environ.get("TIERFS_IMAGE") or made_image_name()


def made_image_name() -> str:
    """The name `make image` gives the image by default."""
    env = {name: value for name, value in os.environ.items() if name != "IMAGE"}
    return subprocess.run(["make", "-s", "--no-print-directory", "image-name"], cwd=ROOT,
                          env=env, check=True, capture_output=True, text=True).stdout.strip()


def manifest_pod() -> dict[str, Any]:
    """The pod spec of the DaemonSet's template."""
    return yaml.safe_load(MANIFEST.read_text())["spec"]["template"]["spec"]


@dataclass
class Site:
    """What a node and its cluster give the pod: the node's name and address (the fields the
    manifest reads), the Secret's items, the host paths behind the manifest's hostPath
    volumes (each one named), and replacement values of options of the command."""

    node_name: str
    node_ip: str
    secret: dict[str, str]
    host_paths: dict[str, Path]
    options: dict[str, str] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)  # the node's, for the init containers


class DaemonSetPod:
    """One pod of the DaemonSet on this machine: a podman container of the image."""

    def __init__(self, site: Site, work_dir: Path, image: str | None = None) -> None:
        self.site = site
        self.work_dir = work_dir  # the Secret's files go here
        self.image = image or image_name()
        self.pod = manifest_pod()
        (self.container,) = self.pod["containers"]
        self.name = f"tierfs-test-{site.node_name}-{uuid.uuid4().hex[:8]}"
        self.started: list[str] = []  # every container this pod ran, to remove them all

    # The manifest, read as the kubelet reads it.

    def environment(self, container: dict[str, Any] | None = None) -> dict[str, str]:
        """The container's variables: literal values, the node's fields, the Secret's keys
        (an optional key that is missing leaves its variable unset)."""
        fields = {"spec.nodeName": self.site.node_name, "status.hostIP": self.site.node_ip}
        env: dict[str, str] = {}
        for item in (container or self.container).get("env", []):
            if "value" in item:
                env[item["name"]] = expand(str(item["value"]), env)
                continue
            source = item["valueFrom"]
            if "fieldRef" in source:
                env[item["name"]] = fields[source["fieldRef"]["fieldPath"]]
                continue
            ref = source["secretKeyRef"]
            if ref["key"] in self.site.secret:
                env[item["name"]] = self.site.secret[ref["key"]]
            elif not ref.get("optional", False):
                raise KeyError(f"the Secret has no {ref['key']!r}, which the pod needs")
        return env

    def command(self) -> list[str]:
        """The container's command, $(NAME) expanded, with the site's option values."""
        env = self.environment()
        argv = [expand(arg, env) for arg in self.container["command"]]
        for option, value in self.site.options.items():
            if option not in argv:
                raise KeyError(f"the pod's command has no {option} to replace")
            argv[argv.index(option) + 1] = expand(value, env)
        return argv

    def volume_args(self, container: dict[str, Any] | None = None) -> list[str]:
        """`--volume` per volumeMount: hostPath volumes from the site's host paths, with the
        mount's propagation; a secret volume as files with the manifest's modes; an emptyDir
        as a directory of the pod's."""
        volumes = {volume["name"]: volume for volume in self.pod["volumes"]}
        args: list[str] = []
        for mount in (container or self.container)["volumeMounts"]:
            volume = volumes[mount["name"]]
            if "hostPath" in volume:
                source = self._host_path(volume["hostPath"])
            elif "emptyDir" in volume:
                source = self.work_dir / f"empty-{self.site.node_name}-{volume['name']}"
                source.mkdir(parents=True, exist_ok=True)
            else:
                source = self._secret_dir(volume["name"], volume["secret"])
            options = [PROPAGATION[mount.get("mountPropagation", "None")]]
            if mount.get("readOnly") or "secret" in volume:  # the kubelet's are read-only
                options.append("ro")
            args += ["--volume", f"{source}:{mount['mountPath']}:{','.join(options)}"]
        return args

    def _host_path(self, host_path: dict[str, str]) -> Path:
        path = self.site.host_paths[host_path["path"]]
        kind = host_path.get("type", "")
        if kind == "DirectoryOrCreate":
            path.mkdir(parents=True, exist_ok=True)
        elif kind == "Directory" and not path.is_dir():
            raise FileNotFoundError(f"hostPath {path} is not a directory")
        elif kind == "CharDevice" and not stat.S_ISCHR(path.stat().st_mode):
            raise FileNotFoundError(f"hostPath {path} is not a character device")
        return path

    def _secret_dir(self, name: str, secret: dict[str, Any]) -> Path:
        directory = self.work_dir / f"secret-{self.site.node_name}-{name}"
        directory.mkdir(parents=True, exist_ok=True)
        for item in secret["items"]:
            path = directory / item["path"]
            path.write_text(self.site.secret[item["key"]])
            path.chmod(item.get("mode", secret.get("defaultMode", 0o644)))
        return directory

    def run_args(self) -> list[str]:
        """`podman run`'s arguments for this pod (without the command)."""
        args = ["--detach", "--name", self.name]
        if self.pod.get("hostNetwork"):
            args += ["--network", "host"]
        if self.container.get("securityContext", {}).get("privileged"):
            args.append("--privileged")
        for name, value in self.environment().items():
            args += ["--env", f"{name}={value}"]
        return args + self.volume_args()

    # The pod's life.

    def start(self) -> None:
        """Run the init containers, then the container (a new one after `stop`, as a
        restarted pod)."""
        if self.started:
            self.name = f"{self.name.rsplit('-', 1)[0]}-{uuid.uuid4().hex[:8]}"
        for init in self.pod.get("initContainers", []):
            self._run_init(init)
        self.started.append(self.name)
        podman("run", *self.run_args(), self.image, *self.command())

    def _run_init(self, init: dict[str, Any]) -> None:
        """One init container, to its end, in the tierfs image with a `kubectl` that prints
        the node's label its jsonpath names (the API server's answer for this node)."""
        tools = self.work_dir / f"kubectl-{self.site.node_name}"
        tools.mkdir(parents=True, exist_ok=True)
        script = ["#!/bin/sh", 'case "$*" in']
        for label, value in self.site.labels.items():
            escaped = label.replace(".", "\\.")
            script.append(f"  *'{escaped}'*) printf '%s' '{value}' ;;")
        script += ["esac", ""]
        (tools / "kubectl").write_text("\n".join(script))
        (tools / "kubectl").chmod(0o755)
        env = self.environment(init)
        name = f"{self.name}-init-{init['name']}"
        self.started.append(name)
        args = ["--name", name, "--volume", f"{tools}:/opt/kubectl:ro",
                "--env", "PATH=/opt/kubectl:/usr/local/bin:/usr/bin:/bin"]
        for variable, value in env.items():
            args += ["--env", f"{variable}={value}"]
        podman("run", *args, *self.volume_args(init), self.image,
               *[expand(arg, env) for arg in init["command"]])

    def running(self) -> bool:
        done = podman("inspect", "--format", "{{.State.Running}}", self.name, check=False)
        return done.stdout.strip() == "true"

    def logs(self) -> str:
        done = podman("logs", self.name, check=False)
        return done.stdout + done.stderr

    def exec(self, *argv: str, check: bool = True,
             timeout: float = 120) -> subprocess.CompletedProcess[str]:
        """A command in the running container (a probe, preStop)."""
        return podman("exec", self.name, *argv, check=check, timeout=timeout)

    def ready(self) -> bool:
        """The readinessProbe's command succeeds (False while the container is not up)."""
        probe = self.container["readinessProbe"]["exec"]["command"]
        return self.running() and self.exec(*probe, check=False, timeout=30).returncode == 0

    def stop(self, timeout: float = 120) -> None:
        """As the kubelet stops a pod: the preStop command, then SIGTERM, which unmounts
        (SIGKILL only after terminationGracePeriodSeconds)."""
        self.exec(*self.container["lifecycle"]["preStop"]["exec"]["command"], timeout=timeout)
        grace = str(self.pod["terminationGracePeriodSeconds"])
        podman("stop", "--time", grace, self.name, timeout=timeout)
        exit_code = podman("inspect", "--format", "{{.State.ExitCode}}", self.name).stdout
        assert exit_code.strip() == "0", f"the daemon exited with {exit_code}: {self.logs()}"

    def remove(self) -> None:
        """Remove every container of this pod, running or not."""
        for name in self.started:
            podman("rm", "--force", "--ignore", "--time", "10", name, check=False)


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(NAME) references to the container's variables (unknown ones stay)."""
    return VARIABLE.sub(lambda match: env.get(match.group(1), match.group(0)), text)
