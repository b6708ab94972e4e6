#!/usr/bin/env bash
# `make bed`: a fleet at work, as an on-call engineer sees one. Four real clusters and NATS;
# the chart installed in the hub and in each region the run names, as a platform team
# would, with the operators running; and `make demo`'s run training through them, on GPUs
# each region's serving fleet lends, until `make down` (which stops the run first, so it
# reports). Three minutes into training region-a's serving traffic spikes for two: its
# operator reclaims the lent GPUs, and lends them again once traffic falls.
set -euo pipefail
rlfleet dev up
export KUBECONFIG=$PWD/.rlfleet/dev/kubeconfig
# COLUMNS: the run's log (rich wraps its lines at the width it is told).
COLUMNS=160 rlfleet run examples/local.yaml --operator --detach --minutes 600 --spike region-a:3-5
for c in hub region-a region-b; do
  echo "== $c: kubectl get rlfleet -A"
  kubectl --context "$c" get rlfleet -A
done
echo
echo "The fleet is at work. Try: export KUBECONFIG=$KUBECONFIG"
echo "  kubectl --context hub get rlrun -A -w          # phase, version, GPUs lent, regions"
echo "  kubectl --context region-a get inferencepool -A -w   # the reclaim, from minute 3"
echo "  kubectl --context hub get events -A            # what the operators decided, and why"
echo "Stop it with: make down"
