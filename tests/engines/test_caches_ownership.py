"""Every process tree rlfleet starts compiles into caches it owns, never into the user's
shared defaults (a kernel another build left in torch's shared cache kills vLLM at
start-up), and an engine that dies at start-up says why in one line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from rlfleet.launch.caches import (
    CACHE_FOLDERS,
    CACHE_ROOT_ENV,
    SOCKETS_ENV,
    cache_env,
    sockets_folder,
)
from rlfleet.launch.settings import WorkerConfig, to_json

COMPILE = "import torch; torch.compile(lambda x: x.sin() * 2)(torch.ones(8))"


def test_a_test_sessions_processes_compile_into_the_sessions_caches(
    session_caches: Path, tmp_path: Path
) -> None:
    home = tmp_path / "home"
    home.mkdir()
    env = os.environ | {"HOME": str(home)}
    env.pop("XDG_CACHE_HOME", None)
    done = subprocess.run(
        [sys.executable, "-c", COMPILE], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    # Nothing in the user's home, and the kernels and inductor's precompiled headers (kept
    # under $TMPDIR whatever its cache folder) under the session's root.
    assert sorted(home.rglob("*")) == []
    assert any((session_caches / CACHE_FOLDERS["TORCHINDUCTOR_CACHE_DIR"]).rglob("*.so"))
    owned = session_caches / CACHE_FOLDERS["TMPDIR"]
    assert any(owned.glob("torchinductor_*/precompiled_headers/*.gch"))
    assert os.environ[CACHE_ROOT_ENV] == str(session_caches)


def test_an_engine_that_cannot_start_says_why_in_its_last_log_line(tmp_path: Path) -> None:
    config = tmp_path / "worker.json"
    missing = tmp_path / "no-model"
    config.write_bytes(
        to_json(WorkerConfig(run="r", nats_url="nats://127.0.0.1:1", model=str(missing)))
    )
    done = subprocess.run(
        [sys.executable, "-m", "rlfleet.rollout", str(config)],
        capture_output=True,
        text=True,
        timeout=300,
        env=os.environ | {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
    )
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert "vLLM engine did not start: " in last and str(missing) in last, done.stderr[-3000:]


def test_a_tree_under_a_deep_root_makes_its_sockets_where_their_paths_fit(tmp_path: Path) -> None:
    """vLLM's IPC socket paths (its base, "/" and a 36-character id) must fit in 107 bytes;
    a local run's state folder can be deeper than that leaves room for."""
    shallow, deep, other = Path("/srv/r"), tmp_path / ("run-" * 20), tmp_path / ("other-" * 15)
    assert cache_env(shallow)[SOCKETS_ENV] == cache_env(shallow)["TMPDIR"]  # a pod's
    for root in (deep, other):
        assert len(cache_env(root)[SOCKETS_ENV]) + 37 <= 107
    assert sockets_folder(deep) != sockets_folder(other)  # each tree's own
