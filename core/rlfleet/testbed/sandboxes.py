"""EnvPool pods on the bed: each one's session server run as a local process at its pod IP.

kwok runs no container, so the bed plays two more parts of a node for EnvPools. As the
kubelet, `SandboxKubelet` starts the command of every Running sandbox pod (the session
server, `rlfleet.rollout.envpool.server`, with the settings the operator wrote) and stops it
when the pod goes, writing the pod's tokens Secret where the server reads it, as a
mounted Secret is kept current. The bed's kwok gives pods loopback addresses (`kube.py`),
so each server listens at its pod's own IP and port, where the operator probes it. As
kube-proxy, `service_url` is a local round-robin relay over a pool's Running pods: what
rollout workers reach as the pool's Service.

The server runs from this environment rather than the image (`tests/engines/test_images.py`
runs the image's), and its paths are moved under STATE_ROOT.
"""

from __future__ import annotations

import base64
import json
import logging
import shutil
import socket
import sys
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from rlfleet.api.meta import COMPONENT_LABEL, ENVPOOL_LABEL
from rlfleet.launch.settings import ENVPOOL_SERVER
from rlfleet.local.processes import Supervisor

log = logging.getLogger(__name__)

# Outside /tmp, which each sandbox covers with its own: servers refuse state below it.
STATE_ROOT = "/run/rlfleet/bed-sandboxes"
# Uids of their own for each server's sandboxes: a process limit counts every sandbox of
# a uid, on one machine as in a pod's VM.
UID_BASE, UID_STRIDE = 2_000_000, 4096


@dataclass
class SandboxKubelet:
    """Keeps one session server per Running sandbox pod of the clusters' namespaces."""

    list_pods: Callable[[str, str], list[dict]]  # (cluster, namespace) -> its sandbox pods
    read_secret: Callable[[str, str, str], dict[str, str] | None]  # cluster, ns, name -> data
    clusters: list[str]
    namespaces: list[str]
    supervisor: Supervisor
    interval_s: float = 1.0
    running: dict[str, tuple[str, dict]] = field(default_factory=dict)  # key -> (name, pod)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.state = Path(STATE_ROOT)  # its own folder below, once started
        self._uids = iter(range(UID_BASE, UID_BASE + 200 * UID_STRIDE, UID_STRIDE))
        self._thread: threading.Thread | None = None
        self.relays: list[Relay] = []
        self.ready: set[str] = set()  # pods whose server answers its probe

    def start(self) -> SandboxKubelet:
        if self._thread is not None:
            return self
        # Root's alone: each sandbox's tree is the root of its own mount namespace.
        Path(STATE_ROOT).mkdir(parents=True, exist_ok=True)
        Path(STATE_ROOT).chmod(0o700)
        self.state = Path(tempfile.mkdtemp(dir=STATE_ROOT))
        self._thread = threading.Thread(target=self._loop, daemon=True, name="sandbox-kubelet")
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.sync()
            except Exception:  # a cluster away for a while: the next sync tries again
                log.exception("sandbox pods: sync failed")

    def sync(self) -> None:
        live = {}
        for cluster in self.clusters:
            for namespace in self.namespaces:
                for pod in self.list_pods(cluster, namespace):
                    meta, status = pod["metadata"], pod.get("status", {})
                    running = status.get("phase") == "Running" and status.get("podIP")
                    if running and not meta.get("deletionTimestamp"):
                        live[f"{cluster}/{namespace}/{meta['name']}"] = (cluster, pod)
        with self._lock:
            for key in sorted(set(self.running) - set(live)):
                name, _ = self.running.pop(key)
                log.info("sandbox pod %s is gone: stopping %s", key, name)
                self.supervisor.stop(name, grace_seconds=10)
            self.ready &= set(live)
            for key, (cluster, pod) in sorted(live.items()):
                self._write_tokens(cluster, pod)
                if key not in self.running:
                    self.running[key] = (self._start(key, pod), pod)
                elif key not in self.ready and _answers(pod["status"]["podIP"], self.port(pod)):
                    self.ready.add(key)  # as its readiness probe would find it

    def _folder(self, pod: dict) -> Path:
        meta = pod["metadata"]
        return self.state / f"{meta['namespace']}-{meta['name']}-{meta['uid'][:8]}"

    def _write_tokens(self, cluster: str, pod: dict) -> None:
        """The pod's tokens Secret, as the kubelet keeps a mounted one current."""
        (volume,) = [v for v in pod["spec"]["volumes"] if v["name"] == "tokens"]
        secret = volume["secret"]["secretName"]
        data = self.read_secret(cluster, pod["metadata"]["namespace"], secret) or {}
        folder = self._folder(pod) / "tokens"
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        for key, value in data.items():
            text = base64.b64decode(value)
            path = folder / key
            if not path.exists() or path.read_bytes() != text:
                staged = path.with_name(f".{key}")
                staged.write_bytes(text)
                staged.chmod(0o600)
                staged.replace(path)

    def _start(self, key: str, pod: dict) -> str:
        """The pod's command, its settings moved onto this machine (`$(POD_IP)` filled in
        as the kubelet fills it)."""
        (container,) = pod["spec"]["containers"]
        ip = pod["status"]["podIP"]
        settings = json.loads(container["command"][-1].replace("$(POD_IP)", ip))
        folder = self._folder(pod)
        tokens = Path(settings["tokens_file"])
        (mount,) = [m for m in container["volumeMounts"] if m["name"] == "tokens"]
        settings |= {
            "host": ip,
            "tokens_file": str(folder / "tokens" / tokens.relative_to(mount["mountPath"])),
            "snapshots_dir": str(folder / "snapshots"),
            "mounts_dir": str(folder / "sandboxes"),
            "uid_base": next(self._uids),
            "sandbox_python": "/usr/bin/python3",
        }
        name = f"sandbox-{key.replace('/', '-')}"
        log.info("sandbox pod %s is running: serving at %s", key, settings["advertise"])
        self.supervisor.start(
            name, [sys.executable, "-I", "-m", ENVPOOL_SERVER, json.dumps(settings)]
        )
        return name

    @staticmethod
    def port(pod: dict) -> int:
        (container,) = pod["spec"]["containers"]
        return json.loads(container["command"][-1])["port"]

    def service_url(self, cluster: str, namespace: str, envpool: str) -> str:
        """A relay standing in for the pool's Service: each connection to the next of its
        ready pods, in turn."""

        def endpoints() -> list[tuple[str, int]]:
            with self._lock:
                return [
                    (pod["status"]["podIP"], self.port(pod))
                    for key, (_, pod) in sorted(self.running.items())
                    if key in self.ready
                    and key.startswith(f"{cluster}/{namespace}/")
                    and pod["metadata"]["labels"].get(ENVPOOL_LABEL) == envpool
                    and pod["metadata"]["labels"].get(COMPONENT_LABEL) == "sandbox"
                ]

        relay = Relay(endpoints)
        self.relays.append(relay)
        return f"http://127.0.0.1:{relay.port}"

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        for relay in self.relays:
            relay.close()
        with self._lock:
            for name, _ in self.running.values():
                self.supervisor.stop(name, grace_seconds=10)
            self.running.clear()
        if self._thread is not None:
            shutil.rmtree(self.state, ignore_errors=True)


class Relay:
    """A TCP relay that sends each connection to the next endpoint, as kube-proxy does."""

    def __init__(self, endpoints: Callable[[], list[tuple[str, int]]]) -> None:
        self.endpoints = endpoints
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self._next = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return  # closed
            targets = self.endpoints()
            if not targets:
                client.close()
                continue
            target = targets[self._next % len(targets)]
            self._next += 1
            try:
                upstream = socket.create_connection(target, timeout=5)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(target=pump, args=(source, sink), daemon=True).start()

    def close(self) -> None:
        self.listener.close()


def pump(
    source: socket.socket,
    sink: socket.socket,
    closed: Callable[[socket.socket, socket.socket], None] | None = None,
) -> None:
    """Copies one direction of a relayed connection until either end closes, then closes
    both (and tells `closed`)."""
    try:
        while chunk := source.recv(65536):
            sink.sendall(chunk)
    except OSError:
        pass
    finally:
        for sock in (source, sink):
            sock.close()
        if closed is not None:
            closed(source, sink)


def _answers(ip: str, port: int) -> bool:
    try:
        with socket.create_connection((ip, port), timeout=0.5):
            return True
    except OSError:
        return False
