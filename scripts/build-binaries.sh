#!/usr/bin/env bash
# Builds the test bed's binaries from Go modules, caches them per version in the user's
# cache directory, and links them into ./.bin. A second run with warm caches is a no-op.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
source "$root/versions.env"
cache=${RLFLEET_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/rlfleet}
bindir="$root/.bin"
mkdir -p "$cache/bin" "$bindir"
command -v go >/dev/null || export PATH=$PATH:/usr/local/go/bin
command -v go >/dev/null || { echo "Go is required to build the test bed's binaries" >&2; exit 1; }
export GOFLAGS=-mod=mod GOTOOLCHAIN=local CGO_ENABLED=0
ldflags_strip="-s -w"

# built NAME VERSION: true when NAME at VERSION is already in the cache.
built() { [ -x "$cache/bin/$1-$2/$1" ]; }

link() { ln -sf "$cache/bin/$1-$2/$1" "$bindir/$1"; }

# Fresh throwaway module directory for one build.
moddir() { local d="$cache/build/$1"; rm -rf "$d"; mkdir -p "$d"; echo "$d"; }

build_kubernetes() {
  local v=$KUBERNETES_VERSION names=(kube-apiserver kube-controller-manager kube-scheduler kubectl)
  local missing=0 n
  for n in "${names[@]}"; do built "$n" "$v" || missing=1; done
  if [ $missing = 1 ]; then
    echo "building Kubernetes $v control plane (cold: tens of minutes on 2 cores)"
    local d; d=$(moddir kubernetes)
    local upstream
    upstream=$(cd "$d" && go mod download -json "k8s.io/kubernetes@$v" | python3 -c 'import json,sys; print(json.load(sys.stdin)["GoMod"])')
    # k8s.io/kubernetes points its staging modules at ./staging; map each to its release.
    local staging="v0.${v#v1.}"
    {
      echo "module rlfleet.local/kubernetes"
      echo "go 1.26.0"
      echo "require k8s.io/kubernetes $v"
      grep -oE '^\s+k8s\.io/[a-z0-9-]+ => \./staging/src/k8s\.io/[a-z0-9-]+' "$upstream" |
        awk -v s="$staging" '{print "replace " $1 " => " $1 " " s}'
    } > "$d/go.mod"
    printf 'package tools\n\nimport (\n\t_ "k8s.io/kubernetes/cmd/kube-apiserver"\n)\n' > "$d/tools.go"
    (cd "$d" && go mod tidy)
    local pkg="k8s.io/component-base/version" minor
    minor=$(echo "$v" | cut -d. -f2)
    local ld="$ldflags_strip -X $pkg.gitVersion=$v -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor -X $pkg.gitTreeState=clean"
    ld="$ld -X k8s.io/client-go/pkg/version.gitVersion=$v"
    for n in "${names[@]}"; do
      built "$n" "$v" && continue
      mkdir -p "$cache/bin/$n-$v"
      (cd "$d" && go build -trimpath -ldflags "$ld" -o "$cache/bin/$n-$v/$n" "k8s.io/kubernetes/cmd/$n")
    done
  fi
  for n in "${names[@]}"; do link "$n" "$v"; done
}

build_etcd() {
  local v=$ETCD_VERSION
  if ! built etcd "$v"; then
    echo "building etcd $v"
    local d; d=$(moddir etcd)
    printf 'module rlfleet.local/etcd\n\ngo 1.26.0\n\nrequire go.etcd.io/etcd/server/v3 %s\n' "$v" > "$d/go.mod"
    printf 'package main\n\nimport (\n\t"os"\n\n\t"go.etcd.io/etcd/server/v3/etcdmain"\n)\n\nfunc main() { etcdmain.Main(os.Args) }\n' > "$d/main.go"
    (cd "$d" && go mod tidy && mkdir -p "$cache/bin/etcd-$v" &&
      go build -trimpath -ldflags "$ldflags_strip" -o "$cache/bin/etcd-$v/etcd" .)
  fi
  link etcd "$v"
}

# go_install NAME MODULE/PATH VERSION: a released command with no replace directives.
go_install() {
  local n=$1 pkg=$2 v=$3
  if ! built "$n" "$v"; then
    echo "building $n $v"
    mkdir -p "$cache/bin/$n-$v"
    GOBIN="$cache/bin/$n-$v" go install -trimpath -ldflags "$ldflags_strip" "$pkg@$v"
  fi
  link "$n" "$v"
}

# kwok runs nothing without stages: take its fast node and pod stages, with lease
# heartbeats so the node lifecycle controller keeps the fake nodes Ready.
kwok_stages() {
  local v=$KWOK_VERSION out="$cache/bin/kwok-$KWOK_VERSION/kwok-stages.yaml"
  if [ ! -s "$out" ]; then
    local src
    src="$(go env GOMODCACHE)/sigs.k8s.io/kwok@$v/kustomize/stage"
    [ -d "$src" ] || (cd "$cache" && go mod download "sigs.k8s.io/kwok@$v")
    for f in "$src"/node/fast/*.yaml "$src"/node/heartbeat-with-lease/*.yaml "$src"/pod/fast/*.yaml; do
      [ "$(basename "$f")" = kustomization.yaml ] && continue
      echo "---"; cat "$f"
    done > "$out"
  fi
  ln -sf "$out" "$bindir/kwok-stages.yaml"
}

build_etcd
go_install kwok sigs.k8s.io/kwok/cmd/kwok "$KWOK_VERSION"
kwok_stages
go_install helm helm.sh/helm/v4/cmd/helm "$HELM_VERSION"
go_install versitygw github.com/versity/versitygw/cmd/versitygw "$VERSITYGW_VERSION"
build_kubernetes
echo "binaries ready in $bindir"
