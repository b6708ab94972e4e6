"""PID 1 of a sandbox: prepares it as root, then runs the environment server unprivileged.

Standard library only. Started by the session server (`envsessions`) inside fresh
network, PID, mount, IPC and UTS namespaces; argv[1] is a JSON object with the settings.
It starts in two steps, so that a pool can keep sandboxes warm:

1. At once: a size-limited tmpfs (the disk limit) and a private, empty scratch directory
   over each shared one (/tmp, /dev/shm: else sessions could pass files). Then it prints
   `{"ready": true}` and waits.
2. On the claim, one JSON line on stdin: the uid, the rlimits, the disk size, and the
   starting tree: a snapshot to fork and/or files. A snapshot is forked as an overlay
   (the snapshot the read-only lower layer, the sandbox's tmpfs the upper one, with
   `metacopy` so that handing the tree to the sandbox's uid copies no data), or copied
   where the kernel offers no overlay. Then it forks the server under that uid (so the
   process limit counts only this sandbox) with its limits, and reaps every orphan until
   the server exits. When it exits the kernel kills everything left in the PID namespace.
"""

import base64
import json
import os
import resource
import shutil
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


def _mount(*args: str) -> bool:
    return subprocess.run(["mount", *args], stderr=subprocess.DEVNULL).returncode == 0


def prepare(settings: dict) -> Path:
    root = Path(settings["root"])
    size = f"size={settings['disk_bytes']},mode=755"
    if not _mount("-t", "tmpfs", "-o", size, "tmpfs", str(root)):
        raise SystemExit("could not mount the sandbox's tmpfs")
    shutil.copyfile(settings["server"], root / "envserver.py")
    for index, shared in enumerate(settings["private_dirs"]):
        scratch = root / f"scratch{index}"
        scratch.mkdir()
        scratch.chmod(0o1777)
        if not _mount("--bind", str(scratch), shared):
            raise SystemExit(f"could not cover {shared}")
    return root


MANIFEST = "snapshot-files.json"  # beside the working tree: see `envserver._archive`


def fork_snapshot(snapshot: str, manifest: str, root: Path, work: Path) -> str:
    """The snapshot under `work`, as an overlay if the kernel offers one, else a copy; and
    beside it the list of the snapshot's files (the session server's), so an archive can
    leave them out."""
    shutil.copyfile(manifest, root / MANIFEST)
    upper, scratch = root / "upper", root / "overlay-work"
    upper.mkdir()
    scratch.mkdir()
    options = f"lowerdir={snapshot},upperdir={upper},workdir={scratch},metacopy=on"
    if _mount("-t", "overlay", "overlay", "-o", options, str(work)):
        return "overlay"
    shutil.copytree(snapshot, work, symlinks=True, dirs_exist_ok=True)  # keeps mtimes
    return "copy"


def start(claim: dict, settings: dict, root: Path) -> str:
    work = root / "work"
    work.mkdir()
    fork = "none"
    if claim["snapshot"]:
        fork = fork_snapshot(claim["snapshot"], claim["manifest"], root, work)
    for relative, content in claim.get("files", {}).items():
        target = work / relative  # paths checked by the session server
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(base64.b64decode(content))
    uid = claim["uid"]
    # On an overlay, a change of owner copies the inode's metadata up, never its data.
    subprocess.run(["chown", "-R", "--no-dereference", f"{uid}:{uid}", str(work)], check=True)
    if claim["disk_bytes"] != settings["disk_bytes"]:
        _mount("-o", f"remount,size={claim['disk_bytes']}", str(root))
    return fork


def main() -> None:
    settings = json.loads(sys.argv[1])
    root = prepare(settings)
    print(json.dumps({"ready": True}), flush=True)
    line = sys.stdin.readline()
    if not line:
        return  # the pool let it go unclaimed
    claim = json.loads(line)
    fork = start(claim, settings, root)
    print(json.dumps({"started": True, "fork": fork}), flush=True)
    uid = claim["uid"]
    child = os.fork()
    if child == 0:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
        for name, limit in LIMITS.items():
            resource.setrlimit(limit, (claim["limits"][name], claim["limits"][name]))
        work = root / "work"
        os.chdir(work)
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(work), "LANG": "C.UTF-8"}
        os.execve(settings["python"], [settings["python"], "-I", str(root / "envserver.py")], env)
    while True:
        pid, status = os.wait()
        if pid == child:
            sys.exit(os.waitstatus_to_exitcode(status))


if __name__ == "__main__":
    main()
