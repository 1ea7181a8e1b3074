"""The `tierfs` command line: mount, umount, status, commit and demo.

User mistakes end with one line on stderr and a non-zero exit, never a traceback. It starts
without trio, pyfuse3 or boto3 (tests/test_cli.py checks): those come in only with the daemon
(`mount`), and torch only with `demo`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import pwd
import select
import subprocess
import sys
import threading
import time
from typing import Any

from tierfs.mount_helper import control, fuse_helper, status_view, verify_view
from tierfs.mount_helper.config import MOUNT_OPTIONS, ConfigError, resolve
from tierfs.mount_helper.mounts import (
    DaemonState,
    MountEntry,
    daemon_state,
    mount_at,
    process_state,
    ram_dir_of,
)
from tierfs.mount_helper.status_view import format_status, human_bytes

READY_TIMEOUT = 120.0
REFUSED_EXIT_TIMEOUT = 10.0  # how long a refused daemon is given to exit
COMMIT_QUIET = 1.0  # seconds before `tierfs commit` says what it waits for

EPILOG = """\
examples:
  tierfs mount /checkpoints                      RAM tier in /dev/shm/tierfs, half of memory
  tierfs mount /checkpoints --ram-limit 64G --ram-dir /dev/shm/ckpt
  tierfs status /checkpoints                     table of steps; --json for scripts
  tierfs status /checkpoints/run1                only run1's steps
  tierfs status /checkpoints --watch -n 5        the same, redrawn every 5 s until Ctrl-C
  tierfs commit /checkpoints/run1/step_100       commit a step that did not commit by itself
  tierfs commit /checkpoints/run1/step_100 --timeout 60    the same, waiting 60 s at most
  tierfs mount /checkpoints --persist s3://bucket/ckpt --persist-every 10 --keep-persist 5
  tierfs flush /checkpoints --timeout 600        wait until the persistent tier has every step
  tierfs verify /checkpoints/run1                check every copy of every step; repair bad ones
  tierfs umount /checkpoints

A step directory (name matching --step-pattern, e.g. step_100, checkpoint-500, 100) commits
by itself once no file of it is open for writing and nothing in it changed for --commit-idle
seconds, at once when the next step directory is made beside it or a file named .metadata
appears in it (the end of a DCP save), when a directory is renamed onto a step name, at a clean
unmount, or with `tierfs commit`. `latest` in a directory names its newest committed step.
"""


class UserError(Exception):
    """Printed as one line, exit status 1."""


def build_parser() -> argparse.ArgumentParser:
    return _parser_and_commands()[0]


def command_names() -> frozenset[str]:
    """The subcommands: what the mount helper form's first operand is never."""
    return _parser_and_commands()[1]


def _parser_and_commands() -> tuple[argparse.ArgumentParser, frozenset[str]]:
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
            mount.add_argument(flag, action="store_true", default=None,
                               help=option.argparse_help())
        else:
            mount.add_argument(flag, metavar=option.metavar, default=None,
                               help=option.argparse_help())
    mount.add_argument("--ready-fd", type=int, help=argparse.SUPPRESS)

    umount = commands.add_parser("umount", help="unmount and stop the daemon")
    umount.add_argument("mountpoint", metavar="MOUNTPOINT")
    umount.add_argument("--flush", action="store_true",
                        help="first wait until every committed step meets the persistence and "
                        "replication policy (as `tierfs flush`)")
    umount.add_argument("--force", action="store_true",
                        help="unmount even if committed steps due in the persistent tier are "
                        "not there yet and no peer holds them (they stay in the RAM dir, and "
                        "go up at its next mount); without it, umount refuses")
    umount.add_argument("--timeout", type=_seconds, metavar="SECONDS",
                        help="with --flush: stop waiting after this many seconds (then "
                        "umount refuses, as for steps not in the store, unless --force)")

    flush = commands.add_parser(
        "flush", help="wait until every committed step meets the persistence and replication "
        "policy",
        description="Wait until every step being written has committed (a step whose saver "
        "is done commits by itself within --commit-idle), every committed step that "
        "--persist-every selects is in the persistent tier (in a cluster, every step of the "
        "cluster, whichever nodes hold its files: a copy on a peer is not the store) and, in a "
        "cluster, every step made here that the store does not hold has --replicas verified "
        "copies on live peers (as many as are up, if fewer), showing progress. Exits 0 only "
        "then; exits 1 naming each step left and why if --timeout passes first, or at once "
        "when waiting cannot finish: a file of a step held open for writing, a step that does "
        "not commit by itself (a save cut short) or not before --timeout, or a step that can "
        "never reach the store (a file of it on no live node).")
    flush.add_argument("mountpoint", metavar="MOUNTPOINT")
    flush.add_argument("--timeout", type=float, metavar="SECONDS",
                       help="give up after this many seconds (default: wait as long as it takes)")

    status = commands.add_parser(
        "status", help="show steps, their states, ages, sizes and tiers",
        description="Show the steps under PATH (the mountpoint, a run directory or a step): "
        "state, version, files, size, age and tiers of each, `latest` of each run directory, "
        "one summary line per run directory, and warnings for data that exists only in this "
        "node's RAM, a step whose commit waits, or a committed step that is incomplete (a "
        "file that no live node and no store holds: `latest` skips it).")
    status.add_argument("mountpoint", metavar="PATH")
    status.add_argument("--json", action="store_true", help="machine-readable output")
    status.add_argument("--watch", action="store_true",
                        help="redraw every --interval seconds until Ctrl-C; not on a "
                        "terminal, print one snapshot per interval, a blank line between")
    status.add_argument("-n", "--interval", type=_seconds, default=2.0, metavar="SECONDS",
                        help="seconds between redraws with --watch (default 2)")

    commit = commands.add_parser(
        "commit", help="commit the step directory PATH now (waits for its open writers)",
        description="Commit the step PATH (a step directory or a file step) now. A file of the "
        "step that is being written is waited for until it is closed (a file counts as being "
        "written from its first write after an open, with passthrough from the open for "
        "writing, until that descriptor's close); after a second the command says on stderr "
        "what it waits for: each such file, and the pid of the process that opened it. A "
        "file open for writing but not being written is committed as it is; what is written "
        "into it later starts the next version. Exits 1 with one line if the step cannot "
        "commit, or if --timeout passes first (the step then stays as it was).")
    commit.add_argument("path", metavar="PATH")
    commit.add_argument("--timeout", type=_seconds, metavar="SECONDS",
                        help="give up after this many seconds (default: wait as long as it "
                        "takes)")

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
        "again. A peer that cannot be asked (down) is unreachable: its copies do not count. "
        "Exits 0 when every file has a good copy on a tier reached: silently when each has "
        "K + 1 copies in RAM (here and on peers) or one in the persistent tier, else with a "
        "warning line naming the files with fewer; exits 1 naming each file that has no "
        "reachable copy and the nodes that held it last, or with a one-line reason for a bad "
        "copy that was not repaired.")
    verify.add_argument("path", metavar="PATH")
    verify.add_argument("--json", action="store_true", help="machine-readable report")
    verify.add_argument("--no-repair", action="store_true",
                        help="check and report, repair nothing (a bad RAM copy is still "
                        "taken out of service, so that it is never read)")

    commands.add_parser("demo", help="train, checkpoint, crash and resume on a local mount "
                        "(what `make demo` runs)")
    return parser, frozenset(commands.choices)


def mount_helper_main() -> int:
    """The `mount.fuse.tierfs` entry point (mount(8) runs it for `-t fuse.tierfs`)."""
    argv = sys.argv[1:]
    if not fuse_helper.is_helper_form(argv, command_names()):
        name = os.path.basename(sys.argv[0])
        print(f"usage: {name} SOURCE MOUNTPOINT [-o name=value,...] (run by mount(8); "
              "`tierfs --help` lists the options)", file=sys.stderr)
        return 2
    return main(argv)


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
    parser, commands = _parser_and_commands()
    if fuse_helper.is_helper_form(argv, commands):  # as mount.fuse3 runs tierfs
        try:
            argv = fuse_helper.to_mount_argv(argv)
        except ConfigError as exc:
            print(f"tierfs: {exc}", file=sys.stderr)
            return 1
    args = parser.parse_args(argv)
    try:
        if args.command == "mount":
            return _mount(args, argv)
        if args.command == "umount":
            if args.timeout is not None and not args.flush:
                raise UserError("umount --timeout needs --flush (it bounds the flush)")
            return _umount_reporting(args.mountpoint, args.flush, args.force, args.timeout)
        if args.command == "flush":
            return _flush(args.mountpoint, args.timeout)
        if args.command == "status":
            if args.watch:
                return _watch(args.mountpoint, args.json, args.interval)
            return _status(args.mountpoint, args.json)
        if args.command == "commit":
            return _commit(args.path, args.timeout)
        if args.command == "prefetch":
            return _prefetch(args.path)
        if args.command == "verify":
            return _verify(args.path, args.json, not args.no_repair)
        if args.command == "demo":
            # a program of its own (torch, the local servers of tierfs.devtools), which runs
            # `tierfs` as its user would: started, not imported
            os.execv(sys.executable, [sys.executable, "-m", "tierfs.demo"])
    except (UserError, ConfigError, control.ControlError) as exc:
        print(f"tierfs: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 2


def _mount(args: argparse.Namespace, argv: list[str]) -> int:
    cfg = resolve(args.mountpoint, vars(args), os.environ, args.config)
    if cfg.foreground or args.ready_fd is not None:
        from tierfs.mount_helper.daemon import assembly  # pyfuse3 and trio: only in the daemon

        return assembly.run(cfg, args.ready_fd)
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
                    # A refused daemon exits at once; until it has, a probe of a mount that
                    # does not answer may still hold that mount busy (an umount right after
                    # this command failed with EBUSY).
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        child.wait(timeout=REFUSED_EXIT_TIMEOUT)
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
    _may_unmount(mountpoint, entry)
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


def _may_unmount(mountpoint: str, entry: MountEntry) -> None:
    """Only root and the user who mounted it may unmount a FUSE mount; say so, rather than
    fusermount3's "entry ... not found in /etc/mtab"."""
    user = os.geteuid()
    if user == 0 or entry.owner is None or entry.owner == user:
        return
    try:
        owner = pwd.getpwuid(entry.owner).pw_name
    except KeyError:
        owner = f"uid {entry.owner}"
    who = "root" if entry.owner == 0 else f"{owner} or root"
    raise UserError(f"cannot unmount {mountpoint}: it was mounted by {owner}, and only {who} "
                    "may unmount it")


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


def _umount_reporting(mountpoint: str, flush: bool, force: bool = False,
                      timeout: float | None = None) -> int:
    """`tierfs umount [--flush [--timeout S]] [--force]`: the quiet steps commit first (so
    that --flush persists them too: the way to end a job, deploy/'s epilog and unit);
    committed steps that would stay only in this node's RAM, though due in the store, and with
    --flush any committed step the store does not hold, stop the unmount unless --force; then
    the unmount, and the steps left uncommitted or not in the store are named."""
    entry = mount_at(os.path.abspath(mountpoint))
    if entry is not None:
        _may_unmount(mountpoint, entry)  # before a flush it could not finish with
    status = _settle(mountpoint)
    if flush:
        try:
            _flush(mountpoint, timeout, report=False)
        except UserError as exc:
            if not force:
                raise UserError(f"not unmounted: {exc}; --force unmounts anyway") from None
            print(f"tierfs: warning: {exc}", file=sys.stderr)
        status = _settle(mountpoint)  # what the flush left, and steps that turned quiet
    alone, held = status_view.store_lines(status) if status is not None else (None, None)
    if alone is not None and not force:
        raise UserError(f"not unmounted: {alone}; `tierfs flush` waits for the store, "
                        "--force unmounts anyway")
    outcome = _umount(mountpoint)
    if status is not None:
        _warn_uncommitted(status)
        if alone is not None:
            print(f"tierfs: warning: {alone}; they stay in RAM dir {status['ram_dir']} and go "
                  "up at its next mount", file=sys.stderr)
        if held is not None:
            print(f"tierfs: {held}", file=sys.stderr)
    return outcome


def _settle(mountpoint: str) -> dict[str, Any] | None:
    """Ask a running daemon to commit its quiet steps now, and its status after that; None
    when it is not asked (a stopped or dead daemon must not delay the unmount) or refuses."""
    entry = mount_at(os.path.abspath(mountpoint))
    ram_dir = ram_dir_of(entry) if entry is not None else None
    if ram_dir is None or daemon_state(ram_dir).state != "running":
        return None
    try:
        socket_path, _root, _rel = control.locate(mountpoint)
        return control.request(socket_path, {"cmd": "settle"}, timeout=None)["status"]
    except control.ControlError:
        return None


def _status(path: str, as_json: bool) -> int:
    socket_path, _root, relpath = control.locate(path)
    print(_status_text(socket_path, relpath, as_json))
    return 0


def _status_text(socket_path: str, relpath: str, as_json: bool) -> str:
    """The status of PATH's subtree, as JSON or as the table a person reads."""
    status = status_view.subtree(control.request(socket_path, {"cmd": "status"})["status"],
                                 relpath)
    return json.dumps(status, indent=2) if as_json else format_status(status)


CLEAR_SCREEN = "\033[H\033[2J"


def _watch(path: str, as_json: bool, interval: float) -> int:
    """`status --watch`: a live view on a terminal (clear and redraw), else a snapshot per
    interval; Ctrl-C is how it is meant to end, so it ends with status 0."""
    socket_path, _root, relpath = control.locate(path)
    on_terminal = sys.stdout.isatty()
    before = ""  # what separates a snapshot from the one before it
    try:
        while True:
            text = _status_text(socket_path, relpath, as_json)
            if on_terminal:
                print(f"{CLEAR_SCREEN}{time.strftime('%H:%M:%S')}  every {interval:g} s, "
                      f"Ctrl-C to stop\n{text}", flush=True)
            else:
                print(before + text, flush=True)
                before = "\n"
            time.sleep(interval)
    except KeyboardInterrupt:
        return 0


def _seconds(text: str) -> float:
    try:
        seconds = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not 0 < seconds < float("inf"):
        raise argparse.ArgumentTypeError("must be a positive number of seconds")
    return seconds


WRITER_GRACE = 1.0  # seconds: a file closed just before a flush may be seen open this long
# (FUSE's RELEASE of a closed file reaches the daemon after close() has returned)


def _flush(mountpoint: str, timeout: float | None, report: bool = True) -> int:
    """Poll the daemon until no step is being written (with `report`; `umount --flush` has
    committed the quiet ones and names those left) and nothing waits for the persistent tier
    or for copies on peers; draw progress meanwhile. A step being written whose saver is
    done commits by itself within --commit-idle (`fs.lifecycle.quiet_commits`): the flush waits for
    that, as a user who flushes right after the job expects. UserError (exit 1) if the
    timeout passes first, or at once when what is left cannot finish: a step with a file
    held open for writing, one that does not commit by itself (a save cut short) or not
    before the timeout, or, with nothing else left, steps the store can never get whole (a
    file on no live node)."""
    socket_path, _root, _rel = control.locate(mountpoint)
    started = time.monotonic()
    deadline_ns = math.inf if timeout is None else time.time_ns() + timeout * 1e9
    on_terminal = sys.stderr.isatty()
    first_bytes: int | None = None
    last_report = 0.0
    writers_since: dict[str, float] = {}  # steps seen with files open for writing, since when
    while True:
        status = control.request(socket_path, {"cmd": "status"})["status"]
        persist, replication = status.get("persist"), status.get("replication")
        writing = status_view.being_written(status) if report else []
        now = time.monotonic()
        writers_since = {s["path"]: writers_since.get(s["path"], now) for s in writing
                         if (s.get("commit_outlook") or {}).get("kind") == "writers"}
        held_open = {path for path, since in writers_since.items()
                     if now - since >= WRITER_GRACE}
        stuck = status_view.cannot_commit(writing, deadline_ns, held_open)
        if stuck:
            if on_terminal and first_bytes:
                print(file=sys.stderr)
            raise UserError(f"flush cannot complete: {status_view.steps_are(writing, 'step')} "
                            "not committed, so in no tier but this node's RAM, and waiting "
                            f"will not commit {len(stuck)} of them"
                            f"{' within --timeout' if timeout is not None else ''}: "
                            f"{status_view.commit_waits(writing)} (`tierfs commit PATH` commits "
                            "one as it is)")
        if persist is None and not (replication and replication["replicas"]):
            if not writing:
                print("no persistent tier (--persist) and no peer copies (--replicas) are "
                      "configured: nothing to flush")
                return 0
            persist = replication = None
        waits = [w for w in (persist, replication) if w is not None]
        steps = sum(w["pending_steps"] for w in waits) + len(
            (persist or {}).get("pending_deletes", ()))
        pending = sum(w["pending_bytes"] for w in waits)
        first_bytes = pending if first_bytes is None else max(first_bytes, pending)
        elapsed = time.monotonic() - started
        if steps == 0 and not writing:
            if on_terminal and first_bytes:
                print(file=sys.stderr)
            flushed = (f"{human_bytes(first_bytes)} flushed in {elapsed:.1f} s" if first_bytes
                       else "nothing was waiting")
            print(f"every committed step is {_flush_goal(persist, replication)} ({flushed})"
                  if waits else f"every step is committed ({elapsed:.1f} s)")
            return 0
        blocked = status_view.blocked_in_store(status)
        if blocked and len(blocked) == steps and not writing:  # nothing that waiting brings
            if on_terminal and first_bytes:
                print(file=sys.stderr)
            raise UserError(f"flush cannot complete: {len(blocked)} steps can never be whole "
                            f"in {persist['url'] if persist else 'the store'}: "
                            + status_view.flush_left(status))
        if timeout is not None and elapsed > timeout:
            if on_terminal:
                print(file=sys.stderr)
            left = ([f"{status_view.steps_are(writing, 'step')} not committed yet: "
                     + status_view.commit_waits(writing)] if writing else []) + (
                [f"{steps} steps ({human_bytes(pending)}) not yet "
                 f"{_flush_goal(persist, replication)}: {status_view.flush_left(status)}"]
                if steps else [])
            raise UserError(f"flush timed out after {timeout:g} s: " + "; ".join(left))
        done = first_bytes - pending
        if on_terminal:
            draw_progress("flushing", done / first_bytes if first_bytes else 0.0,
                          f"{human_bytes(done)} of {human_bytes(first_bytes)}, "
                          f"{steps + len(writing)} steps left")
        elif time.monotonic() - last_report > 5:
            last_report = time.monotonic()
            print(f"flushing: {steps + len(writing)} steps ({human_bytes(pending)}) left: "
                  + "; ".join(([status_view.commit_waits(writing)] if writing else [])
                              + ([status_view.flush_left(status)] if steps else [])),
                  flush=True)
        time.sleep(0.2)


def _flush_goal(persist: dict[str, Any] | None, replication: dict[str, Any] | None) -> str:
    """Where a flush puts the committed steps: `in s3://b/p or on 1 peer` (a step the store
    holds needs no peer copies; one it is not due in does)."""
    goals = [f"in {persist['url']}"] if persist is not None else []
    if replication and replication["replicas"]:
        wanted = replication["wanted"]
        goals.append(f"on {wanted} peer{'s' * (wanted > 1)}" if wanted
                     else "on no peer (none is up)")
    return " or ".join(goals)


def _warn_uncommitted(status: dict[str, Any]) -> None:
    """Steps still being written are in no tier but this node's RAM: say which."""
    line = status_view.uncommitted(status)
    if line is not None:
        print(f"tierfs: {line}", file=sys.stderr)


def draw_progress(doing: str, share: float, detail: str) -> None:
    """One progress line on stderr (a terminal), drawn over the previous one."""
    share = max(0.0, min(1.0, share))
    bar = "#" * int(30 * share) + "." * (30 - int(30 * share))
    print(f"\r{doing} [{bar}] {100 * share:3.0f}%  {detail} ", end="", file=sys.stderr,
          flush=True)


def _request_meanwhile(socket_path: str, message: dict[str, Any]
                       ) -> tuple[threading.Thread, dict[str, Any]]:
    """Send a request that takes long from a thread, so that the caller can show progress
    meanwhile; once the thread is done, the dict holds the "reply" or the "error"."""
    outcome: dict[str, Any] = {}

    def send() -> None:
        try:
            outcome["reply"] = control.request(socket_path, message, timeout=None)
        except control.ControlError as exc:
            outcome["error"] = exc

    worker = threading.Thread(target=send, daemon=True)
    worker.start()
    return worker, outcome


def _prefetch(path: str) -> int:
    """Run the fetch in the daemon; meanwhile draw its progress from the step's status."""
    socket_path, _root, relpath = control.locate(path)
    started = time.monotonic()
    worker, outcome = _request_meanwhile(socket_path, {"cmd": "prefetch", "path": relpath})
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
    worker, outcome = _request_meanwhile(
        socket_path, {"cmd": "verify", "path": relpath, "repair": repair})
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
        print(verify_view.format_verify(steps))
    failure = verify_view.failure(steps, repair)
    if failure is not None:
        raise UserError(failure)
    for warning in verify_view.warnings(steps):
        print(f"tierfs: warning: {warning}", file=sys.stderr)
    return 0


def _commit(path: str, timeout: float | None) -> int:
    """Commit in the daemon; from a second on, say on stderr what the commit waits for (again
    whenever that changes)."""
    socket_path, _root, relpath = control.locate(path)
    if relpath == ".":
        raise UserError(f"{path} is the mount root, not a step directory")
    message: dict[str, Any] = {"cmd": "commit", "path": relpath}
    if timeout is not None:
        message["timeout"] = timeout  # the daemon gives up, with nothing left half done
    worker, outcome = _request_meanwhile(socket_path, message)
    worker.join(COMMIT_QUIET)
    shown = None
    while worker.is_alive():
        with contextlib.suppress(control.ControlError):  # the commit's reply says what failed
            waiting = control.request(socket_path, {"cmd": "commit_waits", "path": relpath}
                                      )["waiting_for"]
            if waiting and waiting != shown and worker.is_alive():
                print(f"committing {relpath}: waiting for {waiting}", file=sys.stderr,
                      flush=True)
                shown = waiting
        worker.join(0.5)
    if "error" in outcome:
        raise outcome["error"]
    reply = outcome["reply"]
    print(f"committed {reply['path']} version {reply['version']}: {reply['files']} files, "
          f"{human_bytes(reply['bytes'])}")
    return 0
