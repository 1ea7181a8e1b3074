"""The `tierfs` command line: mount, umount, status, commit and demo.

User mistakes end with one line on stderr and a non-zero exit, never a traceback. It starts
without trio, pyfuse3 or boto3 (tests/test_cli.py checks): those come in only with the daemon
(`mount`), and torch only with `demo`.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import subprocess
import sys
import threading
import time
from typing import Any

from tierfs.mount_helper import control, fuse_helper
from tierfs.mount_helper.config import MOUNT_OPTIONS, ConfigError, resolve
from tierfs.mount_helper.mounts import (
    DaemonState,
    daemon_state,
    mount_at,
    process_state,
    ram_dir_of,
)
from tierfs.step_names import some_names

READY_TIMEOUT = 120.0

EPILOG = """\
examples:
  tierfs mount /checkpoints                      RAM tier in /dev/shm/tierfs, half of memory
  tierfs mount /checkpoints --ram-limit 64G --ram-dir /dev/shm/ckpt
  tierfs status /checkpoints                     table of steps; --json for scripts
  tierfs commit /checkpoints/run1/step_100       commit a step that did not commit by itself
  tierfs mount /checkpoints --persist s3://bucket/ckpt --persist-every 10 --keep-persist 5
  tierfs flush /checkpoints --timeout 600        wait until the persistent tier has every step
  tierfs verify /checkpoints/run1                check every copy of every step; repair bad ones
  tierfs umount /checkpoints

A step directory (name matching --step-pattern, e.g. step_100, checkpoint-500, 100) commits
when a file named .metadata appears in it (the end of a DCP save), when a directory is renamed
onto a step name, or with `tierfs commit`. `latest` in a directory names its newest committed step.
"""


class UserError(Exception):
    """Printed as one line, exit status 1."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tierfs", description="Tiered checkpoint filesystem: a FUSE mount whose writes land "
        "in RAM and whose step directories commit atomically.", epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    mount = commands.add_parser(
        "mount", help="mount tierfs (returns once the mount answers)",
        description="Mount tierfs at MOUNTPOINT. Every option can also be set as an environment "
        "variable TIERFS_<NAME> (e.g. TIERFS_RAM_LIMIT=64G) or in the TOML file given by "
        "--config (e.g. ram-limit = \"64G\"); the command line wins, then the environment.")
    mount.add_argument("mountpoint", metavar="MOUNTPOINT")
    mount.add_argument("--config", metavar="FILE", help="TOML file with mount options")
    for option in MOUNT_OPTIONS:
        flag = "--" + option.name
        if option.kind == "flag":
            mount.add_argument(flag, action="store_true", default=None, help=option.help)
        else:
            mount.add_argument(flag, metavar=option.metavar, default=None,
                               help=(option.help % {"default": option.default})
                               .replace("%", "%%"))  # argparse expands % itself
    mount.add_argument("--ready-fd", type=int, help=argparse.SUPPRESS)

    umount = commands.add_parser("umount", help="unmount and stop the daemon")
    umount.add_argument("mountpoint", metavar="MOUNTPOINT")
    umount.add_argument("--flush", action="store_true",
                        help="first wait until every committed step meets the persistence policy")

    flush = commands.add_parser(
        "flush", help="wait until every committed step meets the persistence policy",
        description="Wait until every committed step that --persist-every selects is in the "
        "persistent tier, showing progress. Exits 1 if --timeout passes first.")
    flush.add_argument("mountpoint", metavar="MOUNTPOINT")
    flush.add_argument("--timeout", type=float, metavar="SECONDS",
                       help="give up after this many seconds (default: wait as long as it takes)")

    status = commands.add_parser("status", help="show steps, their states, sizes and tiers")
    status.add_argument("mountpoint", metavar="MOUNTPOINT")
    status.add_argument("--json", action="store_true", help="machine-readable output")

    commit = commands.add_parser("commit", help="commit the step directory PATH now")
    commit.add_argument("path", metavar="PATH")

    prefetch = commands.add_parser(
        "prefetch", help="pull a committed step into this node's RAM (from peers or S3)",
        description="Fetch every file of the committed step PATH that is not in this node's "
        "RAM, from the peers that hold it or else the persistent tier, verifying each one.")
    prefetch.add_argument("path", metavar="PATH")

    verify = commands.add_parser(
        "verify", help="check every copy of the committed steps under PATH; repair bad ones",
        description="Check every file of each committed step under PATH (a step directory, or "
        "a directory holding steps) against its manifest, on every tier that holds it: this "
        "node's RAM, each peer that holds a copy, and the persistent tier. A bad copy is "
        "repaired from a good one: a RAM copy is fetched again from a peer or the persistent "
        "tier, a peer pulls a good copy back, a bad object in the persistent tier is uploaded "
        "again. Exits 0 when every copy is good or was repaired, 1 with a one-line reason "
        "otherwise.")
    verify.add_argument("path", metavar="PATH")
    verify.add_argument("--json", action="store_true", help="machine-readable report")
    verify.add_argument("--no-repair", action="store_true",
                        help="check and report, repair nothing (a bad RAM copy is still "
                        "taken out of service, so that it is never read)")

    commands.add_parser("demo", help="train, checkpoint, crash and resume on a local mount "
                        "(what `make demo` runs)")
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        status = _run(argv)
        sys.stdout.flush()  # here, not at exit, so that a closed pipe is seen below
        return status
    except BrokenPipeError:
        # The reader went away (`tierfs status | head`): what it did not read is not wanted.
        # Like any tool killed by SIGPIPE, exit 128 + 13, and no traceback at exit either.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


def _run(argv: list[str] | None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if fuse_helper.is_helper_form(argv):  # `tierfs SOURCE DIR -o ...`, as mount.fuse3 runs it
        try:
            argv = fuse_helper.to_mount_argv(argv)
        except ConfigError as exc:
            print(f"tierfs: {exc}", file=sys.stderr)
            return 1
    args = build_parser().parse_args(argv)
    try:
        if args.command == "mount":
            return _mount(args, argv)
        if args.command == "umount":
            if args.flush:
                _flush(args.mountpoint, None)
            return _umount(args.mountpoint)
        if args.command == "flush":
            return _flush(args.mountpoint, args.timeout)
        if args.command == "status":
            return _status(args.mountpoint, args.json)
        if args.command == "commit":
            return _commit(args.path)
        if args.command == "prefetch":
            return _prefetch(args.path)
        if args.command == "verify":
            return _verify(args.path, args.json, not args.no_repair)
        if args.command == "demo":
            from tierfs.devtools.demo import run_demo  # imports torch: only when asked

            return run_demo()
    except (UserError, ConfigError, control.ControlError) as exc:
        print(f"tierfs: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 2


def _mount(args: argparse.Namespace, argv: list[str]) -> int:
    cfg = resolve(args.mountpoint, vars(args), os.environ, args.config)
    if cfg.foreground or args.ready_fd is not None:
        from tierfs.mount_helper import daemon  # pyfuse3 and trio: only in the daemon

        return daemon.run(cfg, args.ready_fd)
    return _start_daemon(argv)


def _start_daemon(argv: list[str]) -> int:
    """Start the daemon detached and wait for its one-line verdict on a pipe."""
    read_fd, write_fd = os.pipe()
    command = [sys.executable, "-m", "tierfs", *argv, "--ready-fd", str(write_fd)]
    with open(os.devnull, "rb") as devnull:
        child = subprocess.Popen(command, stdin=devnull, stdout=subprocess.DEVNULL,
                                 stderr=subprocess.PIPE, pass_fds=(write_fd,),
                                 start_new_session=True)
    os.close(write_fd)
    deadline = time.monotonic() + READY_TIMEOUT
    buffer = b""
    with os.fdopen(read_fd, "rb", buffering=0) as pipe:
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise UserError(f"the daemon (pid {child.pid}) did not report ready in "
                                f"{READY_TIMEOUT:.0f} s; see its log")
            if not select.select([pipe], [], [], remaining)[0]:
                continue
            chunk = pipe.read(4096)
            if not chunk:
                break
            buffer += chunk
            *lines, buffer = buffer.split(b"\n")
            for line in lines:
                kind, _, message = line.decode(errors="replace").partition(" ")
                if kind == "WARN":
                    print(f"tierfs: warning: {message}", file=sys.stderr)
                elif kind == "ERR":
                    raise UserError(message)
                elif kind == "OK":
                    child.stderr.close()
                    return 0
    # The pipe closed without a verdict: the child died before it could say why.
    child.wait(timeout=10)
    detail = child.stderr.read().decode(errors="replace").strip().splitlines()
    raise UserError(f"the daemon exited with status {child.returncode}"
                    + (f": {detail[-1]}" if detail else ""))


def _umount(mountpoint: str) -> int:
    """Unmount, then wait for the daemon to exit. The daemon is found from /proc (the mount's
    source names its RAM dir), so a stopped or dead daemon cannot hang this."""
    path = os.path.abspath(mountpoint)
    entry = mount_at(path)
    if entry is None:
        raise UserError(f"{mountpoint} is not mounted")
    ram_dir = ram_dir_of(entry)
    daemon = daemon_state(ram_dir) if ram_dir is not None else _ask_pid(path)
    done = subprocess.run(["fusermount3", "-u", path], capture_output=True, text=True)
    if done.returncode != 0:
        reason = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "failed"
        raise UserError(f"cannot unmount {mountpoint}: {reason}")
    if daemon.state == "gone":
        print(f"tierfs: removed the dead mount {mountpoint} (its daemon was gone)",
              file=sys.stderr)
    if daemon.pid is None:
        return 0
    outcome = _wait_for_exit(daemon.pid, 60)
    if outcome == "stopped":
        raise UserError(f"unmounted {mountpoint}, but its daemon (pid {daemon.pid}) is stopped "
                        f"and exits only once resumed: `kill -CONT {daemon.pid}`")
    if outcome != "gone":
        raise UserError(f"unmounted {mountpoint}, but daemon pid {daemon.pid} is still running")
    return 0


def _ask_pid(path: str) -> DaemonState:
    """The daemon's pid from the daemon itself (a mount whose source does not name its RAM
    dir); a daemon that does not answer is beyond our reach and is not waited for."""
    try:
        socket_path, _root, _rel = control.locate(path)
        pid = control.request(socket_path, {"cmd": "status"})["status"]["pid"]
    except control.ControlError:
        return DaemonState(None, "unknown")
    return DaemonState(pid, "running")


def _wait_for_exit(pid: int, timeout: float) -> str:
    """"gone", "stopped" (it cannot exit before it is resumed) or "running" (timed out)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = process_state(pid)
        if state != "running":
            return state
        time.sleep(0.05)
    return "running"


def _status(mountpoint: str, as_json: bool) -> int:
    socket_path, _root, _rel = control.locate(mountpoint)
    status = control.request(socket_path, {"cmd": "status"})["status"]
    if as_json:
        print(json.dumps(status, indent=2))
    else:
        print(format_status(status))
    return 0


def _flush(mountpoint: str, timeout: float | None) -> int:
    """Poll the daemon until nothing waits for the persistent tier; draw progress meanwhile."""
    socket_path, _root, _rel = control.locate(mountpoint)
    started = time.monotonic()
    on_terminal = sys.stderr.isatty()
    first_bytes: int | None = None
    last_report = 0.0
    while True:
        status = control.request(socket_path, {"cmd": "status"})["status"]
        persist = status.get("persist")
        if persist is None:
            print("no persistent tier is configured (--persist): nothing to flush")
            _warn_uncommitted(status)
            return 0
        steps, pending = persist["pending_steps"], persist["pending_bytes"]
        first_bytes = pending if first_bytes is None else max(first_bytes, pending)
        elapsed = time.monotonic() - started
        if steps == 0:
            if on_terminal and first_bytes:
                print(file=sys.stderr)
            flushed = (f"{human_bytes(first_bytes)} flushed in {elapsed:.1f} s" if first_bytes
                       else "nothing was waiting")
            print(f"every committed step is in {persist['url']} ({flushed})")
            _warn_uncommitted(status)
            return 0
        if timeout is not None and elapsed > timeout:
            if on_terminal:
                print(file=sys.stderr)
            raise UserError(f"flush timed out after {timeout:g} s: {steps} steps "
                            f"({human_bytes(pending)}) not yet in {persist['url']}")
        done = first_bytes - pending
        if on_terminal:
            draw_progress("flushing", done / first_bytes if first_bytes else 0.0,
                          f"{human_bytes(done)} of {human_bytes(first_bytes)}, "
                          f"{steps} steps left")
        elif time.monotonic() - last_report > 5:
            last_report = time.monotonic()
            print(f"flushing: {steps} steps ({human_bytes(pending)}) left", flush=True)
        time.sleep(0.2)


def _warn_uncommitted(status: dict[str, Any]) -> None:
    """Steps still being written are in no tier but this node's RAM: say which."""
    writing = [step["path"] + (f" (waits for {step['waiting_for']})"
                               if step.get("waiting_for") else "")
               for step in status["steps"] if step["state"] != "committed"]
    if writing:
        print(f"tierfs: {len(writing)} steps are not committed, so only in this node's RAM: "
              f"{some_names(writing)}", file=sys.stderr)


def draw_progress(doing: str, share: float, detail: str) -> None:
    """One progress line on stderr (a terminal), drawn over the previous one."""
    share = max(0.0, min(1.0, share))
    bar = "#" * int(30 * share) + "." * (30 - int(30 * share))
    print(f"\r{doing} [{bar}] {100 * share:3.0f}%  {detail} ", end="", file=sys.stderr,
          flush=True)


def _prefetch(path: str) -> int:
    """Run the fetch in the daemon; meanwhile draw its progress from the step's status."""
    socket_path, _root, relpath = control.locate(path)
    outcome: dict[str, Any] = {}

    def fetch() -> None:
        try:
            outcome["reply"] = control.request(socket_path, {"cmd": "prefetch", "path": relpath},
                                               timeout=None)
        except control.ControlError as exc:
            outcome["error"] = exc

    worker = threading.Thread(target=fetch, daemon=True)
    started = time.monotonic()
    worker.start()
    on_terminal = sys.stderr.isatty()
    while worker.is_alive():
        worker.join(0.2)
        if on_terminal:
            step = next((s for s in control.request(socket_path, {"cmd": "status"})["status"]
                         ["steps"] if s["path"] == relpath), None)
            if step is not None and step["bytes"]:
                draw_progress("prefetching", step["ram_bytes"] / step["bytes"],
                              f"{human_bytes(step['ram_bytes'])} of "
                              f"{human_bytes(step['bytes'])}")
    if on_terminal:
        print(file=sys.stderr)
    if "error" in outcome:
        raise outcome["error"]
    fetched = outcome["reply"]["bytes"]
    print(f"{relpath} is in RAM: {human_bytes(fetched)} fetched in "
          f"{time.monotonic() - started:.1f} s")
    return 0


def _verify(path: str, as_json: bool, repair: bool) -> int:
    """Run the check in the daemon; meanwhile draw its progress from the daemon's status."""
    socket_path, _root, relpath = control.locate(path)
    outcome: dict[str, Any] = {}

    def check() -> None:
        try:
            outcome["reply"] = control.request(
                socket_path, {"cmd": "verify", "path": relpath, "repair": repair}, timeout=None)
        except control.ControlError as exc:
            outcome["error"] = exc

    worker = threading.Thread(target=check, daemon=True)
    worker.start()
    on_terminal = sys.stderr.isatty()
    drawn = False
    while worker.is_alive():
        worker.join(0.3)
        if on_terminal and worker.is_alive():
            progress = control.request(socket_path, {"cmd": "status"})["status"].get("verify")
            if progress and progress["total_bytes"]:
                draw_progress("verifying", progress["checked_bytes"] / progress["total_bytes"],
                              f"step {progress['steps_done']} of {progress['steps']}")
                drawn = True
    if drawn:
        print(file=sys.stderr)
    if "error" in outcome:
        raise outcome["error"]
    steps = outcome["reply"]["steps"]
    if as_json:
        print(json.dumps({"steps": steps, "ok": all(s["ok"] for s in steps)}, indent=2))
    else:
        print(format_verify(steps))
    failures = [(s, t) for s in steps for t in s["tiers"] if not t["ok"]]
    if not failures:
        return 0
    step, tier = failures[0]
    if tier["error"]:
        reason = tier["error"]
    else:
        problems = ([f"{len(tier['bad'])} bad ({', '.join(tier['bad'])})"] if tier["bad"]
                    else []) + ([f"{len(tier['missing'])} missing ("
                                 f"{', '.join(tier['missing'])})"] if tier["missing"] else [])
        reason = " and ".join(problems) + (", no good copy to repair from" if repair else "")
    more = f" (and {len(failures) - 1} more)" if len(failures) > 1 else ""
    raise UserError(f"verify: {step['path']} on {tier['tier']}: {reason}{more}")


def format_verify(steps: list[dict[str, Any]]) -> str:
    from tierfs.fs.verify import TierReport, describe

    lines = []
    for step in steps:
        lines.append(f"{step['path']} v{step['version']}: {step['files']} files, "
                     f"{human_bytes(step['bytes'])}")
        for tier in step["tiers"]:
            report = TierReport(**{k: v for k, v in tier.items() if k != "ok"})
            lines.append(f"  {describe(report)}")
    copies = sum(len(s["tiers"]) for s in steps)
    repaired = sum(len(t["repaired"]) for s in steps for t in s["tiers"])
    good = all(s["ok"] for s in steps)
    lines.append(f"{len(steps)} steps, {copies} copies checked: "
                 + ("every copy good" if good else "PROBLEMS FOUND")
                 + (f" ({repaired} files repaired)" if repaired else ""))
    return "\n".join(lines)


def _commit(path: str) -> int:
    socket_path, _root, relpath = control.locate(path)
    if relpath == ".":
        raise UserError(f"{path} is the mount root, not a step directory")
    reply = control.request(socket_path, {"cmd": "commit", "path": relpath}, timeout=None)
    print(f"committed {reply['path']} version {reply['version']}: {reply['files']} files, "
          f"{human_bytes(reply['bytes'])}")
    return 0


def human_bytes(size: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def format_status(status: dict[str, Any]) -> str:
    ram = status["ram"]
    share = 100 * ram["used_bytes"] / max(ram["limit_bytes"], 1)
    lines = [f"tierfs at {status['mountpoint']}  node {status['node_id']}  pid {status['pid']}",
             f"RAM tier {human_bytes(ram['used_bytes'])} of {human_bytes(ram['limit_bytes'])} "
             f"({share:.0f}%) in {status.get('ram_dir', '?')}; file data "
             + ("passes straight to it (FUSE passthrough)" if status.get("passthrough")
                else "goes through the daemon")]
    steps = status["steps"]
    if not steps:
        lines.append("no step directories yet")
        return "\n".join(lines)
    rows = [("PATH", "STEP", "STATE", "VERSION", "FILES", "SIZE", "TIERS")]
    for step in steps:
        tiers = (["ram"] if step["ram"] else []) + [f"peer:{p}" for p in step["replicas"]]
        if step["persisted"]:
            tiers.append("persist")
        rows.append((step["path"], str(step["step"]), step["state"], str(step["version"]),
                     str(step["files"]), human_bytes(step["bytes"]), ",".join(tiers) or "-"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    numeric = {1, 3, 4, 5}
    for row in rows:
        cells = [cell.rjust(w) if i in numeric else cell.ljust(w)
                 for i, (cell, w) in enumerate(zip(row, widths, strict=True))]
        lines.append("  ".join(cells).rstrip())
    lines += [f"{step['path']}: its commit waits for {step['waiting_for']}"
              for step in steps if step.get("waiting_for")]
    return "\n".join(lines)
