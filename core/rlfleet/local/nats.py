"""Embedded NATS for a run on one machine (`rlfleet run`, the test bed): a hub server with
JetStream, and one leaf node per region.

Each region's clients connect to their own leaf node, which reaches the hub over one
leaf connection, so a message crosses the WAN once per region. Every server has its own
JetStream domain (`hub`, or the region's name): clients reach the hub's streams through
the leaf with the `hub` domain. Authentication is on everywhere, with the JWTs of one
operator (`rlfleet.bus.credentials`): nobody is anonymous. The servers' own clients (tests,
the operator, `rlfleet run`) connect as an unrestricted user of the account
(`NatsServer.credentials`).
"""

from __future__ import annotations

import json
import socket
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

from rlfleet.api.wire import BusRole
from rlfleet.bus.connection import CREDENTIALS_ENV, AccountOwner, connect
from rlfleet.bus.credentials import (
    ACCOUNT,
    LEAF,
    OPERATOR,
    NKey,
    Permissions,
    account_jwt,
    account_of,
    mint_user,
    operator_jwt,
    runs_account_jwt,
)
from rlfleet.bus.permissions import USER_TTL_S, leaf_permissions, mint_run_user, renewal_due
from rlfleet.bus.streams import largest_message
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
        """The environment a child process connects with (`rlfleet.bus.connection.connect`
        reads it)."""
        return {CREDENTIALS_ENV: self.credentials}


@dataclass(frozen=True)
class NatsBed:
    hub: NatsServer
    leaves: dict[str, NatsServer]
    signing_seed: str  # a file: the account's signing key, which mints users (runs')
    operator_seed: str  # a file: the NATS operator's key, which signs the account again
    system_credentials: str  # a file: a user of the system account, which sends it out

    def to_json(self) -> str:
        leaves = {k: asdict(v) for k, v in self.leaves.items()}
        return json.dumps(
            {"hub": asdict(self.hub), "leaves": leaves}
            | {k: getattr(self, k) for k in ("signing_seed", "operator_seed", "system_credentials")}
        )

    def owner(self) -> AccountOwner:
        """What revokes a run's users, as the hub operator holds it."""
        return AccountOwner(
            operator_seed=Path(self.operator_seed).read_text(),
            system_credentials=Path(self.system_credentials).read_text(),
            account=account_of(Path(self.hub.credentials).read_text()),
            signer_seed=Path(self.signing_seed).read_text(),
        )

    def run_user(
        self, run: str, role: BusRole, incarnation: str | None = None, ttl_s: float = USER_TTL_S
    ) -> str:
        """The user (.creds text) of one of a run's components, as the hub operator mints
        it; `incarnation`: the run's life it belongs to (a Kubernetes uid; the run's name
        here unless given)."""
        admin = Path(self.hub.credentials).read_text()
        signer = Path(self.signing_seed).read_text()
        return mint_run_user(signer, account_of(admin), run, role, incarnation or run, ttl_s=ttl_s)

    def keep_run_users(self, run: str, files: dict[BusRole, Path]) -> None:
        """Writes each of a run's users to its file, or signs it again there when its time
        is nearly up (`rlfleet.bus.permissions.renewal_due`): its processes reconnect with it."""
        for role, path in files.items():
            if not path.exists() or renewal_due(path.read_text(), time.time(), USER_TTL_S):
                write_secret(path, self.run_user(run, role))

    @classmethod
    def from_json(cls, text: str) -> NatsBed:
        data = json.loads(text)
        leaves = {k: NatsServer(**v) for k, v in data.pop("leaves").items()}
        return cls(NatsServer(**data.pop("hub")), leaves, **data)


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
            # Every server alike, the leaf nodes too: each takes what a stream takes.
            "max_payload": largest_message(),
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


def _trust(state: Path) -> tuple[_Trust, dict[str, NKey]]:
    """The operator, its system account, and the one account runs live in; returns the
    trust and the keys."""
    keys = _keys(state / "keys.json")
    operator, system, account, signer = (
        keys[k] for k in ("operator", "system", "account", "signer")
    )
    write_secret(state / "operator.jwt", operator_jwt(operator, system.public))
    accounts = {
        system.public: account_jwt(operator, system.public, "SYS", None, jetstream=False),
        account.public: runs_account_jwt(operator, account.public, signer.public),
    }
    return _Trust(state / "operator.jwt", system.public, accounts), keys


def _user_creds(path: Path, signer: NKey, account: str, name: str) -> Path:
    """An unrestricted user of the account, written where only its owner reads it."""
    write_secret(path, mint_user(signer.seed, account, name, Permissions()))
    return path


def start_nats(regions: list[str], supervisor: Supervisor, state: Path) -> NatsBed:
    state.mkdir(parents=True, exist_ok=True)
    trust, keys = _trust(state)
    signer, account, system = keys["signer"], keys["account"].public, keys["system"]
    write_secret(state / "signing.seed", signer.seed)
    write_secret(state / "operator.seed", keys["operator"].seed)
    admin = str(_user_creds(state / "admin.creds", signer, account, "admin"))
    # The system account's user: it sends the runs' account, signed again, to every server.
    system_user = _user_creds(state / "system.creds", system, system.public, "system")
    hub, leaf_port, monitor_port = _start_hub(supervisor, state, trust, admin)
    to_hub = _HubLink(f"nats://127.0.0.1:{leaf_port}", signer, account, system.public, system_user)
    leaves = {
        region: _start_leaf(supervisor, state, trust, region, to_hub, admin) for region in regions
    }
    supervisor.wait_until(
        "every region's leaf connections at the hub",
        lambda: _leaf_count(monitor_port) >= 2 * len(leaves),
        30,
        interval=0.1,
    )
    return NatsBed(
        hub, leaves, *(str(state / f) for f in ("signing.seed", "operator.seed", "system.creds"))
    )


def _start_hub(
    supervisor: Supervisor, state: Path, trust: _Trust, admin: str
) -> tuple[NatsServer, int, int]:
    """The hub, started and listening; returns it, and its leaf and monitoring ports."""
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
    return hub, leaf_port, monitor_port


@dataclass(frozen=True)
class _HubLink:
    """How a region's leaf node reaches the hub: the hub's leaf URL, the signing key that
    mints the leaf's user, the account runs live in, and the system account's user."""

    url: str
    signer: NKey
    account: str
    system_account: str
    system_user: Path


def _start_leaf(
    supervisor: Supervisor, state: Path, trust: _Trust, region: str, to_hub: _HubLink, admin: str
) -> NatsServer:
    """A region's leaf node, started and listening."""
    port = free_port()
    # Each region's leaf node logs in to the hub as a user of its own, allowed only
    # what a region does there, and only as a leaf node.
    login = state / f"leaf-{region}.creds"
    allowed = leaf_permissions(HUB_DOMAIN, region)
    write_secret(
        login,
        mint_user(
            to_hub.signer.seed, to_hub.account, f"leaf-{region}", allowed, connections=(LEAF,)
        ),
    )
    conf = trust.conf() | {
        "server_name": f"leaf-{region}",
        "listen": f"127.0.0.1:{port}",
        "jetstream": _jetstream(state / region, region),
        "leafnodes": {
            "remotes": [
                {
                    "urls": [to_hub.url],
                    "credentials": str(login),
                    "account": to_hub.account,
                    "compression": "off",
                },
                # The system account's link: the hub's operator reaches this server
                # through it, to send it the runs' account when a run's users are revoked.
                {
                    "urls": [to_hub.url],
                    "credentials": str(to_hub.system_user),
                    "account": to_hub.system_account,
                    "compression": "off",
                },
            ]
        },
    }
    write_secret(state / f"{region}.conf", _conf(conf))
    supervisor.start(f"nats-{region}", [binary("nats-server"), "-c", str(state / f"{region}.conf")])
    supervisor.wait_until(f"nats {region}", lambda: _listening(port), 30, interval=0.1)
    return NatsServer(region, f"nats://127.0.0.1:{port}", region, admin)


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
