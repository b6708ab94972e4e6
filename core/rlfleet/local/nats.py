"""Embedded NATS for a run on one machine (`rlfleet run`, the test bed): a hub server with
JetStream, and one leaf node per region.

Each region's clients connect to their own leaf node, which reaches the hub over one
leaf connection, so a message crosses the WAN once per region. Every server has its own
JetStream domain (`hub`, or the region's name): clients reach the hub's streams through
the leaf with the `hub` domain. Authentication is on everywhere, with the JWTs of one
operator (`rlfleet.bus.auth`): nobody is anonymous. The servers' own clients (tests,
the operator, `rlfleet run`) connect as an unrestricted user of the account
(`NatsServer.credentials`).
"""

from __future__ import annotations

import json
import socket
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

from rlfleet.api.wire import BusRole
from rlfleet.bus.auth import (
    ACCOUNT,
    CREDENTIALS_ENV,
    OPERATOR,
    NKey,
    Permissions,
    account_jwt,
    account_of,
    connect,
    mint_run_user,
    mint_user,
    operator_jwt,
)
from rlfleet.local.binaries import binary
from rlfleet.local.files import write_secret
from rlfleet.local.processes import Supervisor, free_port

HUB_DOMAIN = "hub"
MAX_CONTROL_LINE = 64 << 10


@dataclass(frozen=True)
class NatsServer:
    name: str
    url: str
    domain: str
    credentials: str  # a .creds file: a user of the account allowed everything

    async def connect(self, **options):
        return await connect(self.url, Path(self.credentials), **options)

    def client_env(self) -> dict[str, str]:
        """The environment a child process connects with (`rlfleet.bus.auth.connect` reads it)."""
        return {CREDENTIALS_ENV: self.credentials}


@dataclass(frozen=True)
class NatsBed:
    hub: NatsServer
    leaves: dict[str, NatsServer]
    signing_seed: str  # a file: the account's signing key, which mints users (runs')

    def to_json(self) -> str:
        leaves = {k: asdict(v) for k, v in self.leaves.items()}
        return json.dumps(
            {"hub": asdict(self.hub), "leaves": leaves, "signing_seed": self.signing_seed}
        )

    def run_user(self, run: str, role: BusRole) -> str:
        """The user (.creds text) of one of a run's components, as the hub operator mints
        it."""
        admin = Path(self.hub.credentials).read_text()
        return mint_run_user(Path(self.signing_seed).read_text(), account_of(admin), run, role)

    @classmethod
    def from_json(cls, text: str) -> NatsBed:
        data = json.loads(text)
        leaves = {k: NatsServer(**v) for k, v in data["leaves"].items()}
        return cls(NatsServer(**data["hub"]), leaves, data["signing_seed"])


def _conf(values: dict) -> str:
    # nats-server's configuration format accepts JSON.
    return json.dumps(values, indent=2)


def _jetstream(store: Path, domain: str) -> dict:
    return {
        "store_dir": str(store),
        "domain": domain,
        "max_memory_store": 256 << 20,
        # What the streams may reserve, which their bounds are (a run's trajectories take
        # `spec.trajectoryBacklogMib` when made), not what they hold: room for
        # hundreds of runs' defaults, and a 16 TiB ask (the field's most) is refused.
        "max_file_store": 4 << 40,
    }


def _listening(port: int) -> bool:
    with socket.create_connection(("127.0.0.1", port), timeout=1):
        return True


def _leaf_count(monitor_port: int) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{monitor_port}/leafz", timeout=2) as response:
        return json.load(response).get("leafnodes", 0)


@dataclass(frozen=True)
class _Trust:
    """What every server is configured with: the operator, and the accounts it signed."""

    operator_jwt: Path
    system_account: str
    accounts: dict[str, str]  # public key -> account JWT

    def conf(self) -> dict:
        return {
            "operator": str(self.operator_jwt),
            "system_account": self.system_account,
            "resolver": "MEMORY",
            "resolver_preload": self.accounts,
            # A run's user JWT lists its subjects and streams: longer than the default 4 KiB.
            "max_control_line": MAX_CONTROL_LINE,
        }


def _keys(path: Path) -> dict[str, NKey]:
    """The operator's, the accounts' and the signing key, kept with the servers' stores:
    JetStream files its streams under the account's key, so a restarted bed (a resumed
    `rlfleet run`) must keep the same account to find them."""
    roles = {"operator": OPERATOR, "system": ACCOUNT, "account": ACCOUNT, "signer": ACCOUNT}
    if path.exists():
        return {k: NKey.from_seed(seed) for k, seed in json.loads(path.read_text()).items()}
    keys = {k: NKey.generate(role) for k, role in roles.items()}
    write_secret(path, json.dumps({k: key.seed for k, key in keys.items()}))
    return keys


def _trust(state: Path) -> tuple[_Trust, str, NKey]:
    """The operator, its system account, and the one account runs live in; returns the
    trust, the account's public key and its signing key."""
    keys = _keys(state / "keys.json")
    operator, system, account, signer = (
        keys[k] for k in ("operator", "system", "account", "signer")
    )
    write_secret(state / "operator.jwt", operator_jwt(operator, system.public))
    accounts = {
        system.public: account_jwt(operator, system, "SYS", None, jetstream=False),
        account.public: account_jwt(operator, account, "RLFLEET", signer.public, jetstream=True),
    }
    return _Trust(state / "operator.jwt", system.public, accounts), account.public, signer


def _user_creds(path: Path, signer: NKey, account: str, name: str) -> Path:
    """An unrestricted user of the account, written where only its owner reads it."""
    write_secret(path, mint_user(signer.seed, account, name, Permissions()))
    return path


def start_nats(regions: list[str], supervisor: Supervisor, state: Path) -> NatsBed:
    state.mkdir(parents=True, exist_ok=True)
    trust, account, signer = _trust(state)
    write_secret(state / "signing.seed", signer.seed)
    admin = str(_user_creds(state / "admin.creds", signer, account, "admin"))
    hub_port, leaf_port, monitor_port = free_port(), free_port(), free_port()
    hub = NatsServer("hub", f"nats://127.0.0.1:{hub_port}", HUB_DOMAIN, admin)
    hub_conf = trust.conf() | {
        "server_name": "hub",
        "listen": f"127.0.0.1:{hub_port}",
        "jetstream": _jetstream(state / "hub", HUB_DOMAIN),
        # Weight deltas are zstd already: S2 on the leaf link would only burn CPU.
        "leafnodes": {"listen": f"127.0.0.1:{leaf_port}", "compression": "off"},
        "http": f"127.0.0.1:{monitor_port}",
    }
    write_secret(state / "hub.conf", _conf(hub_conf))
    supervisor.start("nats-hub", [binary("nats-server"), "-c", str(state / "hub.conf")])
    supervisor.wait_until("nats hub", lambda: _listening(hub_port), 30, interval=0.1)

    leaves: dict[str, NatsServer] = {}
    for region in regions:
        port = free_port()
        # Each region's leaf node logs in to the hub as a user of its own.
        login = _user_creds(state / f"leaf-{region}.creds", signer, account, f"leaf-{region}")
        conf = trust.conf() | {
            "server_name": f"leaf-{region}",
            "listen": f"127.0.0.1:{port}",
            "jetstream": _jetstream(state / region, region),
            "leafnodes": {
                "remotes": [
                    {
                        "urls": [f"nats://127.0.0.1:{leaf_port}"],
                        "credentials": str(login),
                        "account": account,
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
        leaves[region] = NatsServer(region, f"nats://127.0.0.1:{port}", region, admin)
    supervisor.wait_until(
        "every region's leaf connection at the hub",
        lambda: _leaf_count(monitor_port) >= len(leaves),
        30,
        interval=0.1,
    )
    return NatsBed(hub, leaves, str(state / "signing.seed"))


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
