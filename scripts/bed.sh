#!/usr/bin/env bash
# `make bed`: brings up four real clusters and NATS, installs rlfleet's CRDs and the examples,
# and shows what an on-call engineer sees. The bed stays up until `make down`.
set -euo pipefail
rlfleet dev up
export KUBECONFIG=$PWD/.rlfleet/dev/kubeconfig
contexts=(hub region-a region-b region-c)
for c in "${contexts[@]}"; do
  kubectl --context "$c" apply --server-side -f crds/ >/dev/null
done
for c in "${contexts[@]}"; do
  kubectl --context "$c" wait --for=condition=Established --timeout=60s \
    crd/rlruns.rlfleet.io crd/inferencepools.rlfleet.io crd/envpools.rlfleet.io >/dev/null
  kubectl --context "$c" apply -f examples/ >/dev/null
done
for c in "${contexts[@]}"; do
  echo "== $c: kubectl get nodes,rlfleet"
  kubectl --context "$c" get nodes -o custom-columns='NAME:.metadata.name,REGION:.metadata.labels.rlfleet\.io/region,GPUS:.status.allocatable.nvidia\.com/gpu,READY:.status.conditions[?(@.type=="Ready")].status'
  kubectl --context "$c" get rlfleet
done
echo
echo "The bed is up. Try: export KUBECONFIG=$KUBECONFIG; kubectl --context region-a get rlfleet"
echo "Stop it with: make down"
