"""Where a process tree keeps its compile caches: under a root of its own.

By default torch inductor compiles into `/tmp/torchinductor_$USER`, Triton into
`~/.triton/cache`, vLLM (its torch.compile cache too) into `~/.cache/vllm`, DeepSpeed's op
builds into `~/.cache/torch_extensions`, CUDA's JIT into `~/.nv/ComputeCache` and
matplotlib its font list into `~/.cache/matplotlib`: folders every process of the user
shares, whatever torch build or CPU wrote them. So the tree's `TMPDIR` is its own too. A vLLM engine
dies at start-up reading a kernel another build left there (a C++ error such as
"`at::vec` has not been declared"). So whoever starts a tree (`rlfleet run`, the test
session, a benchmark, a pod) names a root it owns in `CACHE_ROOT_ENV`, and every process
in it derives the caches' folders from that one variable. The Hugging Face hub cache is
left alone: rlfleet downloads nothing, and that cache is content-addressed and locked.
"""

from __future__ import annotations

import atexit
import hashlib
import os
import shutil
import tempfile
from pathlib import Path

# The root a process tree's caches live under: a pod's is set by the operator (a folder
# of its writable scratch emptyDir); a local tree's by whoever started it.
CACHE_ROOT_ENV = "RLFLEET_CACHE_DIR"

# Each library's variable, and its folder under the root.
CACHE_FOLDERS = {
    "TORCHINDUCTOR_CACHE_DIR": "torchinductor",
    "TRITON_CACHE_DIR": "triton",
    "VLLM_CACHE_ROOT": "vllm",
    "TORCH_EXTENSIONS_DIR": "torch_extensions",
    "CUDA_CACHE_PATH": "cuda",
    "MPLCONFIGDIR": "matplotlib",  # its font cache, made by a run's report
    # Inductor keeps its precompiled C++ headers in `$TMPDIR/torchinductor_$USER` whatever
    # its cache folder: a header another torch build or CPU left there breaks every kernel.
    "TMPDIR": "tmp",
}


# vLLM makes its engine's IPC sockets in `VLLM_RPC_BASE_PATH` (by default the temp
# folder, here the tree's), and a socket's path must fit in 107 bytes (`sockaddr_un`).
# Under a deep root, such as a local run's state folder, vLLM's engine died at start-up
# ("ipc path ... is longer than 107 characters"): such a tree's sockets go in a short
# folder of its own in the system's temp folder instead.
SOCKETS_ENV = "VLLM_RPC_BASE_PATH"
SOCKETS_MAX_CHARS = 64  # vLLM adds "/" and a 36-character id


def sockets_folder(root: Path) -> Path:
    """Where the tree under `root` makes its sockets: its own temp folder if short enough,
    else one named after the root in /tmp (so still the tree's alone)."""
    tmp = root / CACHE_FOLDERS["TMPDIR"]
    if len(str(tmp)) <= SOCKETS_MAX_CHARS:
        return tmp
    return Path("/tmp") / f"rlfleet-sockets-{hashlib.sha256(str(root).encode()).hexdigest()[:16]}"


def cache_env(root: Path) -> dict[str, str]:
    """The environment that puts every compile cache (and vLLM's sockets) under `root`."""
    folders = {var: str(root / f) for var, f in CACHE_FOLDERS.items()}
    return {CACHE_ROOT_ENV: str(root)} | folders | {SOCKETS_ENV: str(sockets_folder(root))}


def own_caches(default_root: Path | None) -> Path | None:
    """Puts this process's (and its children's) compile caches under the root the tree
    already has (`CACHE_ROOT_ENV`, set by whoever started it), else under `default_root`;
    with neither, changes nothing. Returns the root."""
    inherited = os.environ.get(CACHE_ROOT_ENV)
    root = Path(inherited) if inherited else default_root
    if root is not None:
        root = root.absolute()
        os.environ.update(cache_env(root))
        (root / CACHE_FOLDERS["TMPDIR"]).mkdir(parents=True, exist_ok=True)  # else /tmp
        sockets = sockets_folder(root)
        sockets.mkdir(mode=0o700, parents=True, exist_ok=True)
        if sockets.stat().st_uid != os.getuid():  # made by someone else, to listen in
            raise PermissionError(f"{sockets} belongs to another user")
    return root


def own_temporary_caches(prefix: str) -> None:
    """`own_caches` under a fresh temporary folder, removed when this process exits, unless
    the tree has a root already: for a command (a benchmark) that keeps nothing."""
    root = None
    if not os.environ.get(CACHE_ROOT_ENV):
        root = Path(tempfile.mkdtemp(prefix=prefix))
        atexit.register(shutil.rmtree, root, ignore_errors=True)
    own_caches(root)
