# An EnvPool's pod: the environment session server (the package rlfleet.rollout.envpool),
# which makes each sandbox (sandbox_init.py) and runs its tools (envserver.py); standard
# library only, and importing nothing else of rlfleet, so its folder is all the image copies. The operator gives it its settings as the last argument and runs it as root inside
# the pool's runtimeClass (gVisor or Kata), read-only but for its emptyDirs. The tools
# agents use come with the image: build your own FROM this one to add more. From the root:
#   docker build -f images/env-sandbox.Dockerfile -t ghcr.io/rlfleet/env-sandbox:0.1.0 .
FROM python:3.11-slim
RUN apt-get update \
 && apt-get install -y --no-install-recommends git ca-certificates \
 && rm -rf /var/lib/apt/lists/*
COPY rollout/rlfleet/rollout/envpool /usr/local/lib/python3.11/site-packages/rlfleet/rollout/envpool
WORKDIR /work
ENTRYPOINT ["python", "-I", "-m", "rlfleet.rollout.envpool"]
