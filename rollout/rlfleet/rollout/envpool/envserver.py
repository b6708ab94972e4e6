"""The environment server: runs inside a sandbox and executes the harness's tool calls.

Standard library only, started with `python -I`, so a sandbox starts in milliseconds
and trusts nothing outside it. One JSON request per line on stdin, one JSON reply per
line on stdout:

    {"tool": "run", "command": "...", "timeout": 10} -> {"ok": true, "exit_code": 0, "output": ".."}
    {"tool": "read", "path": "a.py"} -> {"ok": true, "output": "..."}
    {"tool": "write", "path": "a.py", "content": "..."} -> {"ok": true, "output": "wrote 3 bytes"}
    {"tool": "archive"} -> {"ok": true, "files": {"a.py": "<base64>"}}
    {"tool": "ping"} -> {"ok": true}

`archive` and `ping` are the harness's own tools, never offered to the model: `archive`
returns every regular file of the working tree (symlinks skipped, and in a tree forked
from an environment the files it left as they were) so the final tree can be graded
elsewhere; `ping` is the session server's check that a new sandbox is up.

Failures are replies too (`{"ok": false, "error": "..."}`): the model sees them as
observations. Paths are relative to the working directory, may not leave it, and hold
no control character.
"""

import base64
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

OUTPUT_LIMIT = 16 << 10  # characters of output the model gets back per call
# A reply is one line, and the session server reads lines of at most its max_body_bytes.
ARCHIVE_LIMIT = 16 << 20  # characters of encoded files in an archive reply


def _clip(text: str) -> str:
    if len(text) <= OUTPUT_LIMIT:
        return text
    half = OUTPUT_LIMIT // 2
    return f"{text[:half]}\n... [{len(text) - OUTPUT_LIMIT} characters cut] ...\n{text[-half:]}"


def _inside(root: Path, path: str) -> Path:
    if any(ord(c) < 0x20 or 0x7F <= ord(c) <= 0x9F for c in path):  # `protocol.has_control`
        raise ValueError(f"path {path!r} holds a control character")
    target = (root / path).resolve()
    if target != root and root not in target.parents:
        raise ValueError(f"path {path!r} leaves the working directory")
    return target


def _run(command: str, timeout: float) -> dict:
    process = subprocess.Popen(
        ["/bin/sh", "-c", command],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        text = output.decode(errors="replace")
        return {"ok": False, "error": f"timed out after {timeout}s", "output": _clip(text)}
    return {
        "ok": True,
        "exit_code": process.returncode,
        "output": _clip(output.decode(errors="replace")),
    }


def _snapshot_files(root: Path) -> dict:
    """The files of the environment this tree was forked from (`sandbox_init.MANIFEST`)."""
    try:
        return json.loads((root.parent / "snapshot-files.json").read_text())
    except (OSError, ValueError):
        return {}


def _archive(root: Path) -> dict:
    files: dict[str, str] = {}
    size = 0
    # A file as the environment left it is not the agent's work: grading forks the same
    # environment. (Disguising an edit as unchanged only loses the edit.)
    unchanged = _snapshot_files(root)
    for directory, _, names in os.walk(root):
        for name in names:
            path = Path(directory) / name
            if path.is_symlink() or not path.is_file():
                continue
            relative = str(path.relative_to(root))
            info = path.stat()
            if unchanged.get(relative) == [info.st_size, info.st_mtime_ns]:
                continue
            # Counted before reading, so a huge file is never loaded; one still growing is
            # read up to the size counted.
            length = info.st_size
            size += 4 * -(-length // 3) + len(json.dumps(relative)) + 4
            if size > ARCHIVE_LIMIT:
                return {
                    "ok": False,
                    "error": f"the working tree is too large to archive: over {ARCHIVE_LIMIT} "
                    "characters of encoded files",
                }
            with path.open("rb") as file:
                files[relative] = base64.b64encode(file.read(length)).decode()
    return {"ok": True, "files": files}


def handle(request: dict, root: Path) -> dict:
    tool = request.get("tool")
    if tool == "run":
        return _run(str(request["command"]), float(request.get("timeout", 30)))
    if tool == "read":
        return {
            "ok": True,
            "output": _clip(_inside(root, request["path"]).read_text(errors="replace")),
        }
    if tool == "write":
        target = _inside(root, request["path"])
        target.parent.mkdir(parents=True, exist_ok=True)
        data = str(request["content"]).encode()
        target.write_bytes(data)
        return {"ok": True, "output": f"wrote {len(data)} bytes to {request['path']}"}
    if tool == "archive":
        return _archive(root)
    if tool == "ping":
        return {"ok": True}
    return {"ok": False, "error": f"unknown tool {tool!r}"}


def main() -> None:
    root = Path.cwd().resolve()
    for line in sys.stdin:
        try:
            reply = handle(json.loads(line), root)
        except (OSError, ValueError, KeyError, TypeError) as error:
            reply = {"ok": False, "error": f"{type(error).__name__}: {error}"}
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
