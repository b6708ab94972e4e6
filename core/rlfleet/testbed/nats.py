"""NATS for the bed: a hub server with JetStream, and one leaf node per region.

Each region's clients connect to their own leaf node, which reaches the hub over one
leaf connection, so a message crosses the WAN once per region. Every server has its own
JetStream domain (`hub`, or the region's name): clients reach the hub's streams through
the leaf with the `hub` domain. Authentication is on everywhere; nobody is anonymous.
"""

from __future__ import annotations

import json
import secrets
import socket
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

from rlfleet.testbed.binaries import binary
from rlfleet.testbed.pki import write_secret
from rlfleet.testbed.processes import Supervisor, free_port

ACCOUNT = "RLFLEET"
HUB_DOMAIN = "hub"


@dataclass(frozen=True)
class NatsServer:
    name: str
    url: str
    user: str
    password: str
    domain: str

    @property
    def authenticated_url(self) -> str:
        host = self.url.removeprefix("nats://")
        return f"nats://{self.user}:{self.password}@{host}"


@dataclass(frozen=True)
class NatsBed:
    hub: NatsServer
    leaves: dict[str, NatsServer]

    def to_json(self) -> str:
        return json.dumps(
            {"hub": asdict(self.hub), "leaves": {k: asdict(v) for k, v in self.leaves.items()}}
        )

    @classmethod
    def from_json(cls, text: str) -> NatsBed:
        data = json.loads(text)
        return cls(
            NatsServer(**data["hub"]), {k: NatsServer(**v) for k, v in data["leaves"].items()}
        )


def _conf(values: dict) -> str:
    # nats-server's configuration format accepts JSON.
    return json.dumps(values, indent=2)


def _jetstream(store: Path, domain: str) -> dict:
    return {
        "store_dir": str(store),
        "domain": domain,
        "max_memory_store": 256 << 20,
        "max_file_store": 4 << 30,
    }


def _listening(port: int) -> bool:
    with socket.create_connection(("127.0.0.1", port), timeout=1):
        return True


def _leaf_count(monitor_port: int) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{monitor_port}/leafz", timeout=2) as response:
        return json.load(response).get("leafnodes", 0)


def start_nats(regions: list[str], supervisor: Supervisor, state: Path) -> NatsBed:
    state.mkdir(parents=True, exist_ok=True)
    hub_port, leaf_port, monitor_port = free_port(), free_port(), free_port()
    hub_user = NatsServer(
        "hub", f"nats://127.0.0.1:{hub_port}", "rlfleet", secrets.token_urlsafe(24), HUB_DOMAIN
    )
    # Each region's leaf node logs in to the hub with credentials of its own.
    leaf_logins = {region: secrets.token_urlsafe(24) for region in regions}
    hub_conf = {
        "server_name": "hub",
        "listen": f"127.0.0.1:{hub_port}",
        "jetstream": _jetstream(state / "hub", HUB_DOMAIN),
        "accounts": {
            ACCOUNT: {
                "jetstream": "enabled",
                "users": [{"user": hub_user.user, "password": hub_user.password}]
                + [{"user": f"leaf-{r}", "password": p} for r, p in leaf_logins.items()],
            }
        },
        # Weight deltas are zstd already: S2 on the leaf link would only burn CPU.
        "leafnodes": {"listen": f"127.0.0.1:{leaf_port}", "compression": "off"},
        "http": f"127.0.0.1:{monitor_port}",
    }
    write_secret(state / "hub.conf", _conf(hub_conf))
    supervisor.start("nats-hub", [binary("nats-server"), "-c", str(state / "hub.conf")])
    supervisor.wait_until("nats hub", lambda: _listening(hub_port), 30, interval=0.1)

    leaves: dict[str, NatsServer] = {}
    for region, login in leaf_logins.items():
        port = free_port()
        server = NatsServer(
            region, f"nats://127.0.0.1:{port}", "rlfleet", secrets.token_urlsafe(24), region
        )
        conf = {
            "server_name": f"leaf-{region}",
            "listen": f"127.0.0.1:{port}",
            "jetstream": _jetstream(state / region, region),
            "accounts": {
                ACCOUNT: {
                    "jetstream": "enabled",
                    "users": [{"user": server.user, "password": server.password}],
                }
            },
            "leafnodes": {
                "remotes": [
                    {
                        "urls": [f"nats://leaf-{region}:{login}@127.0.0.1:{leaf_port}"],
                        "account": ACCOUNT,
                        "compression": "off",
                    }
                ]
            },
        }
        write_secret(state / f"{region}.conf", _conf(conf))
        supervisor.start(
            f"nats-{region}", [binary("nats-server"), "-c", str(state / f"{region}.conf")]
        )
        supervisor.wait_until(f"nats {region}", lambda p=port: _listening(p), 30, interval=0.1)
        leaves[region] = server
    supervisor.wait_until(
        "every region's leaf connection at the hub",
        lambda: _leaf_count(monitor_port) >= len(leaves),
        30,
        interval=0.1,
    )
    return NatsBed(hub_user, leaves)


class StandaloneNats:
    """A hub and one region's leaf node on their own, for tests and benchmarks that need
    NATS without clusters, or restart a server under their clients."""

    region = "region-a"

    def __init__(self, root: Path, *, attached: bool = True) -> None:
        self.supervisor = Supervisor(root / "logs", attached=attached)
        self.bed = start_nats([self.region], self.supervisor, root / "nats")

    def restart_hub(self) -> None:
        """Kill the hub outright and start it again on the same port and store.

        Call it from a thread that outlives the hub: attached children die with the
        thread that started them.
        """
        self.supervisor.restart("nats-hub")
        port = int(self.bed.hub.url.rsplit(":", 1)[1])
        self.supervisor.wait_until("nats hub again", lambda: _listening(port), 30, interval=0.1)

    def stop(self) -> None:
        self.supervisor.stop_all()
