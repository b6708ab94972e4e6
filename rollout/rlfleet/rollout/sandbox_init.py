"""PID 1 of a local sandbox: prepares it as root, runs the environment server unprivileged.

Standard library only. Started by `rlfleet.rollout.sandbox` inside fresh network, PID,
mount, IPC and UTS namespaces; argv[1] is a JSON object with the settings. It mounts a
size-limited tmpfs (the disk limit), copies the attempt's starting state into it, then
forks the server under the sandbox's own uid (so the process limit counts only this
sandbox) with resource limits, and reaps every orphan until the server exits. When it
exits the kernel kills everything left in the PID namespace.
"""

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


def main() -> None:
    settings = json.loads(sys.argv[1])
    root, uid = settings["root"], settings["uid"]
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={settings['disk_bytes']},mode=755", "tmpfs", root],
        check=True,
    )
    work = Path(root) / "work"
    if settings["start"]:
        shutil.copytree(settings["start"], work, symlinks=True)
    else:
        work.mkdir()
    server = Path(root) / "envserver.py"
    shutil.copyfile(settings["server"], server)
    # Shared scratch directories (/tmp, /dev/shm) would let sessions pass files to each
    # other: the session server has each covered (once the start is in) by a private one.
    for index, shared in enumerate(settings.get("private_dirs", [])):
        scratch = Path(root) / f"scratch{index}"
        scratch.mkdir()
        scratch.chmod(0o1777)
        subprocess.run(["mount", "--bind", str(scratch), shared], check=True)
    for directory, _, files in os.walk(work):
        os.chown(directory, uid, uid)
        for name in files:
            os.chown(Path(directory) / name, uid, uid, follow_symlinks=False)
    child = os.fork()
    if child == 0:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
        for name, limit in LIMITS.items():
            resource.setrlimit(limit, (settings["limits"][name], settings["limits"][name]))
        os.chdir(work)
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": work, "LANG": "C.UTF-8"}
        os.execve(settings["python"], [settings["python"], "-I", server], env)
    while True:
        pid, status = os.wait()
        if pid == child:
            sys.exit(os.waitstatus_to_exitcode(status))


if __name__ == "__main__":
    main()
