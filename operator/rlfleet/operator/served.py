"""Which policy version each serving replica of a pool serves, as its own server says.

A production pool's servers (`rlfleet.rollout.production.serving`) export one series of the info
metric `SERVED_WEIGHTS`, labelled with the run whose versions they follow, their replica
set, the version they serve and its digest. The region operator reads it from every
running serving pod and counts pods per run, set and version for the pool's
`status.servedVersions`: on-call sees what production serves from the pods themselves,
not what they were told to serve, and a set stuck on an old version shows as such.
"""

from __future__ import annotations

from collections import Counter

import httpx
from prometheus_client.parser import text_string_to_metric_families
from pydantic import ValidationError

from rlfleet.api.inferencepool import SERVED_WEIGHTS, ServedVersion

MAX_SHOWN = 64  # the status's bound; more groups than that would be a misconfigured pool
Answers = tuple[ServedVersion | None, ...]  # each serving pod's, None if it said nothing

# One client for every pod's read: a client per read builds a TLS context each time.
_client = httpx.Client()


def parse_served(text: str) -> ServedVersion | None:
    """What one server's /metrics says it serves (as one replica), or None if it says
    nothing readable: not rlfleet's server, following no run, or labels out of bounds."""
    # Only its own lines are parsed: vLLM's whole exposition is a hundred times larger.
    mine = "\n".join(line for line in text.splitlines() if line.startswith(SERVED_WEIGHTS))
    try:
        samples = [
            sample.labels
            for family in text_string_to_metric_families(mine)
            for sample in family.samples
            if sample.name == f"{SERVED_WEIGHTS}_info" and sample.value == 1
        ]
    except ValueError:
        return None
    if len(samples) != 1:
        return None
    (labels,) = samples
    try:
        return ServedVersion(
            run=labels.get("run", ""),
            replica_set=labels.get("replica_set", ""),
            version=labels.get("version", ""),
            digest=labels.get("digest", ""),
            replicas=1,
        )
    except ValidationError:
        return None


def read_served(host: str, port: int, timeout_s: float) -> ServedVersion | None:
    """One serving pod's answer; None when it does not answer, or says nothing readable."""
    try:
        response = _client.get(f"http://{host}:{port}/metrics", timeout=timeout_s)
        response.raise_for_status()
    except httpx.HTTPError:
        return None
    return parse_served(response.text)


def count_served(answers: Answers) -> tuple[list[ServedVersion], int]:
    """The pods' answers as counts per run, set, version and digest (the largest
    `MAX_SHOWN`, in that order), and how many pods said no version or fell past the
    bound. Two digests of one version are two entries: a pod whose weights differ from
    its set's shows."""
    counts = Counter((a.run, a.replica_set, a.version, a.digest) for a in answers if a is not None)
    shown = sorted(counts.items(), key=lambda item: (-item[1], item[0]))[:MAX_SHOWN]
    served = [
        ServedVersion(run=run, replica_set=rs, version=version, digest=digest, replicas=n)
        for (run, rs, version, digest), n in sorted(shown)
    ]
    return served, len(answers) - sum(s.replicas for s in served)
