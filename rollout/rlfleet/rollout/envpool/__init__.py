"""The EnvPool session server: many agents' sandboxes behind one authenticated HTTP port.

Standard library only and importing nothing else of rlfleet: the sandbox image copies this
folder alone and installs nothing. It runs as `python -I -m rlfleet.rollout.envpool`, its
settings one JSON object in argv[1] (`rlfleet.launch.settings.ServerConfig` writes it);
once it listens it prints `{"port": N}` on stdout. HTTP rather than NATS request/reply: an
EnvPool pod is reached only by its run's rollout pods (a NetworkPolicy on one port),
answers a kubelet readiness probe, needs no broker in its path and no client library in
its image, and the rollout workers already speak HTTP.

Each session is its own namespace sandbox: `sandbox_init.py` as PID 1 of fresh network,
PID, mount, IPC and UTS namespaces, its root a private size-limited tmpfs (`pivot_root`)
holding only the image's system folders read-only (SYSTEM_DIRS) beside its own tree, a
uid no other live session has, and rlimits; inside it `envserver.py` runs the tools, and
this server speaks JSON lines to it over a pipe. So a session has no network (not even
this server's port), sees neither this server's processes, nor its state (tokens,
environments), nor another session's files, and its uid owns nothing else. Making
namespaces needs root: on one machine the server runs as root, in a pod as root inside
the pod's VM-grade sandbox (gVisor or Kata).

Every call but the probe carries `Authorization: Bearer <token>`; `tokens_file` maps each
run to the token the operator minted for it (a Secret's file, re-read when it changes).
A session belongs to the run that created it. Errors are `{"error": {"message", "type",
"param"}}`, `param` naming the offending field.

    GET    /healthz                -> 200 {"sessions": n, "ready": n, "warming": n,
                                   "waiting": n (claims queued for capacity), ...}
    POST   /v1/sessions            a claim: {"files": {path: base64}} and/or {"snapshot":
                                   name}, optionally "limits" (each at most the server's)
                                   and "wait_seconds" (for capacity; the server's
                                   claim_wait_seconds at most)
                                   -> 201 {"id", "limits", "lease_seconds", "endpoint"}
    POST   /v1/sessions/{id}/call  an envserver request -> 200 its reply
    DELETE /v1/sessions/{id}       -> 200 {"id": ...}
    POST   /v1/leases              {"ids": [...]} -> 200 {"renewed": [...], "gone": [...]}
    PUT    /v1/snapshots/{name}    {"files": {...}, "setup": command} -> 201 built, 200 had

Claims come from a warm pool: `warm` sandboxes wait, namespaces and tmpfs made, for the
claim that gives them their tree, uid and limits (`sandbox_init.py`); the pool refills
behind each claim. A claim with no capacity waits up to its `wait_seconds`, then gets 503.
A session is never handed on: destroyed, its sandbox goes, and a fresh one warms.

In a pod, many servers sit behind one Service: `advertise` is this one's own URL, sent
with each claim (`endpoint`), where the client then sends the session's calls. Each server
builds its own snapshots: a claim naming one it lacks gets 404 `snapshot_missing` with
its `endpoint`, where the client builds it and claims again.

A claimed session holds a lease of `lease_seconds`, renewed by every request naming it
and by `/v1/leases`: a client that dies stops renewing, and its sessions are destroyed.

A snapshot is a named environment set-up, built once per run (its files, then `setup`
run in a session) and forked by every session that names it, as an overlay (see
`sandbox_init.py`). A run keeps at most `max_snapshots`: building one more removes its
least recently forked one that no live session forks (409 if every one is). The run's
own snapshots shadow the pool's shared ones, which the image provides under
`snapshots_dir`. A snapshot holds folders, regular files and links that stay in its own
tree: an absolute link, a relative one that leads out of the tree, a pipe or a device,
and a file with a name outside the tree are left out of it (the reply counts them in
`removed`); a claim's files are never written through a link (422 naming the file).

A session destroyed (by DELETE, at its deadline, when its lease lapsed, or because its
sandbox died) answers 410 saying why; another run's token gets 403; an unknown one 404.

Its modules, by job: `server` wires the others together and serves; `protocol` reads and
writes HTTP and checks request bodies; `auth` holds the runs' tokens; `sandboxes` starts
sandboxes and keeps the warm pool; `claims` makes sessions from claims and ends them;
`snapshots` finds, builds and evicts snapshots; `confinement` keeps the server's state
and snapshots' contents out of sandboxes' reach. `sandbox_init.py` and `envserver.py`
run inside a sandbox, each started by its path, so each stands alone.
"""
