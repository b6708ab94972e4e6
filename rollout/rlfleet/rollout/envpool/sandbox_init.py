"""PID 1 of a sandbox: prepares it as root, then runs the environment server unprivileged.

Standard library only. Started by the session server (`envsessions`) inside fresh
network, PID, mount, IPC and UTS namespaces; argv[1] is a JSON object with the settings.
It starts in two steps, so that a pool can keep sandboxes warm:

1. At once: a size-limited tmpfs (the disk limit) that will be the sandbox's own root:
   the image's system folders (`system_dirs`) bound into it read-only, nosuid and nodev;
   a /dev of a few device files; a /proc of its PID namespace; an empty, private folder
   for each shared one (`private_dirs`: /tmp, /dev/shm: else sessions could pass files).
   Then it prints `{"ready": true}` and waits.
2. On the claim, one JSON line on stdin: the uid, the rlimits, the disk size, and the
   starting tree: a snapshot to fork and/or files. A snapshot is forked as an overlay
   (the snapshot the read-only lower layer, the sandbox's tmpfs the upper one, with
   `metacopy` so that handing the tree to the sandbox's uid copies no data), or copied
   where the kernel offers no overlay. Then it pivots into its tmpfs (`pivot_root`) and
   lets the pod's root go: nothing of the pod is reachable from here on but the system
   folders bound read-only, not the server's environments, other sandboxes, or tokens.
   Only then are the claim's files written, each opened folder by folder without
   following a link (O_NOFOLLOW), so a link a run left in its environment never leads
   root's hand, even inside the sandbox (to its /proc). A file the environment's tree
   keeps from being written (a link, a pipe or a folder in its way) refuses the claim:
   `{"started": false, "param": "files.<path>", "error": ...}`. Then it forks the server
   under that uid (so the process limit counts only this sandbox) with its limits, and
   reaps every orphan until the server exits. When it exits the kernel kills everything
   left in the PID namespace.
"""

import base64
import contextlib
import ctypes
import errno
import json
import os
import resource
import shutil
import stat
import subprocess
import sys
from pathlib import Path

LIMITS = {
    "cpu_seconds": resource.RLIMIT_CPU,
    "memory_bytes": resource.RLIMIT_AS,
    "file_bytes": resource.RLIMIT_FSIZE,
    "processes": resource.RLIMIT_NPROC,
    "open_files": resource.RLIMIT_NOFILE,
}
# <sys/mount.h>
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 0x1, 0x2, 0x4, 0x8
MS_REMOUNT, MS_BIND = 0x20, 0x1000
MNT_DETACH = 0x2
# glibc has no pivot_root(): the system call, by its number on each architecture.
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}
DEVICES = ("null", "zero", "full", "random", "urandom", "tty")
WORK = "work"  # the working tree, below the sandbox's root
MANIFEST = "snapshot-files.json"  # beside the working tree: see `envserver._archive`
OVERLAY = ".overlay"  # the overlay's upper and work folders: root's alone
DIRECTORY = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# Non-blocking: a named pipe in the way refuses at once instead of waiting for a reader.
FILE = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
IN_THE_WAY = {
    errno.ELOOP: "a symbolic link is in its way",
    errno.ENOTDIR: "a file is in its way",
    errno.EISDIR: "a folder is in its way",
    errno.ENXIO: "a pipe or socket is in its way",
}

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = (ctypes.c_char_p,) * 3 + (ctypes.c_ulong, ctypes.c_char_p)
_libc.umount2.argtypes = (ctypes.c_char_p, ctypes.c_int)


class Refused(Exception):
    """The claim cannot start: `param` names its field."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


def _check(result: int, what: str) -> None:
    if result != 0:
        number = ctypes.get_errno()
        raise OSError(number, f"{what}: {os.strerror(number)}")


def _mount(source: str | None, target: Path | str, kind: str | None, flags: int, data=""):
    _check(
        _libc.mount(
            source.encode() if source else None,
            str(target).encode(),
            kind.encode() if kind else None,
            flags,
            data.encode() if data else None,
        ),
        f"mount {target}",
    )


def _bind(source: Path, target: Path, extra: int = MS_RDONLY | MS_NOSUID | MS_NODEV) -> None:
    """`source` at `target`, alone (not the mounts below it: a Secret's, say), then made
    read-only, nosuid and nodev (a bind mount takes its flags from a remount)."""
    _mount(str(source), target, None, MS_BIND)
    if extra:
        _mount(None, target, None, MS_REMOUNT | MS_BIND | extra)


def prepare(settings: dict) -> Path:
    root = Path(settings["root"])
    size = f"size={settings['disk_bytes']},mode=755"
    try:
        _mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, size)
        shutil.copyfile(settings["server"], root / "envserver.py")
        for name in settings["system_dirs"]:
            host, inside = Path(name), root / Path(name).relative_to("/")
            if host.is_symlink():  # /bin -> usr/bin, as the image has it
                inside.symlink_to(host.readlink())
            elif host.is_dir():
                inside.mkdir(parents=True)
                _bind(host, inside)
        dev = root / "dev"
        dev.mkdir()
        for device in DEVICES:
            if Path("/dev", device).exists():
                (dev / device).touch()
                _bind(Path("/dev", device), dev / device, extra=0)
        for name, target in (("fd", ""), ("stdin", "/0"), ("stdout", "/1"), ("stderr", "/2")):
            (dev / name).symlink_to(f"/proc/self/fd{target}")
        (root / "proc").mkdir()
        _mount("proc", root / "proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
        for shared in settings["private_dirs"]:
            scratch = root / Path(shared).relative_to("/")
            scratch.mkdir(parents=True, exist_ok=True)
            scratch.chmod(0o1777)
    except OSError as error:
        raise SystemExit(f"could not prepare the sandbox: {error}") from None
    return root


def fork_snapshot(snapshot: str, manifest: str, root: Path, work: Path) -> str:
    """The snapshot under `work`, as an overlay if the kernel offers one, else a copy; and
    beside it the list of the snapshot's files (the session server's), so an archive can
    leave them out."""
    shutil.copyfile(manifest, root / MANIFEST)
    hidden = root / OVERLAY
    hidden.mkdir(mode=0o700)
    upper, scratch = hidden / "upper", hidden / "work"
    upper.mkdir()
    scratch.mkdir()
    options = f"lowerdir={snapshot},upperdir={upper},workdir={scratch},metacopy=on"
    try:
        _mount("overlay", work, "overlay", 0, options)
        return "overlay"
    except OSError:
        shutil.copytree(snapshot, work, symlinks=True, dirs_exist_ok=True)  # keeps mtimes
        return "copy"


def pivot(root: Path) -> None:
    """Makes `root` this mount namespace's `/` and lets the old one go (pivot_root(2)'s
    "pivot_root(".", ".")" idiom: the old root is stacked on the new one, then detached)."""
    os.chdir(root)
    number = SYS_PIVOT_ROOT.get(os.uname().machine)
    if number is None:
        raise SystemExit(f"no pivot_root for {os.uname().machine}")
    _check(_libc.syscall(number, b".", b"."), "pivot_root")
    _check(_libc.umount2(b".", MNT_DETACH), "umount the pod's root")
    os.chdir("/")


def write_file(work: Path, relative: str, data: bytes) -> None:
    """`data` at `relative` below `work`, every folder on the way opened without following
    a link, and the file too: whatever lies in the way refuses it."""
    param = f"files.{relative}"
    parts = relative.split("/")
    if any(part in ("", ".", "..") for part in parts):
        raise Refused(param, "a file's path must be relative and plain")
    folder = os.open(work, DIRECTORY)
    try:
        for part in parts[:-1]:
            with contextlib.suppress(FileExistsError):
                os.mkdir(part, 0o755, dir_fd=folder)
            inner = os.open(part, DIRECTORY, dir_fd=folder)
            os.close(folder)
            folder = inner
        file = os.open(parts[-1], FILE, 0o644, dir_fd=folder)
        with os.fdopen(file, "wb") as handle:
            if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
                raise Refused(param, "something other than a file is in its way")
            handle.write(data)
    except OSError as error:
        raise Refused(param, IN_THE_WAY.get(error.errno) or os.strerror(error.errno)) from None
    finally:
        with contextlib.suppress(OSError):
            os.close(folder)


def start(claim: dict, settings: dict, root: Path) -> str:
    work = root / WORK
    work.mkdir()
    fork = "none"
    if claim["snapshot"]:
        fork = fork_snapshot(claim["snapshot"], claim["manifest"], root, work)
    pivot(root)
    work = Path("/", WORK)
    for relative, content in claim.get("files", {}).items():
        write_file(work, relative, base64.b64decode(content))
    uid = claim["uid"]
    # On an overlay, a change of owner copies the inode's metadata up, never its data.
    subprocess.run(["chown", "-R", "--no-dereference", f"{uid}:{uid}", str(work)], check=True)
    if claim["disk_bytes"] != settings["disk_bytes"]:
        _mount(None, "/", None, MS_REMOUNT | MS_NOSUID | MS_NODEV, f"size={claim['disk_bytes']}")
    return fork


def main() -> None:
    settings = json.loads(sys.argv[1])
    root = prepare(settings)
    print(json.dumps({"ready": True}), flush=True)
    line = sys.stdin.readline()
    if not line:
        return  # the pool let it go unclaimed
    claim = json.loads(line)
    try:
        fork = start(claim, settings, root)
    except Refused as refused:
        answer = {"started": False, "param": refused.param, "error": str(refused)}
        print(json.dumps(answer), flush=True)
        return
    print(json.dumps({"started": True, "fork": fork}), flush=True)
    uid = claim["uid"]
    child = os.fork()
    if child == 0:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
        for name, limit in LIMITS.items():
            resource.setrlimit(limit, (claim["limits"][name], claim["limits"][name]))
        work = Path("/", WORK)
        os.chdir(work)
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(work), "LANG": "C.UTF-8"}
        os.execve(settings["python"], [settings["python"], "-I", "/envserver.py"], env)
    while True:
        pid, status = os.wait()
        if pid == child:
            sys.exit(os.waitstatus_to_exitcode(status))


if __name__ == "__main__":
    main()
