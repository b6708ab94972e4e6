# An EnvPool's pod: the environment session server (rlfleet.rollout.envsessions), which
# makes each sandbox (sandbox_init.py) and runs its tools (envserver.py); standard library
# only. The operator gives it its settings as the last argument and runs it as root inside
# the pool's runtimeClass (gVisor or Kata), read-only but for its emptyDirs. The tools
# agents use come with the image: build your own FROM this one to add more. From the root:
#   docker build -f images/env-sandbox.Dockerfile -t ghcr.io/rlfleet/env-sandbox:0.1.0 .
FROM python:3.11-slim
RUN apt-get update \
 && apt-get install -y --no-install-recommends git ca-certificates \
 && rm -rf /var/lib/apt/lists/*
COPY rollout/rlfleet/rollout/envsessions.py rollout/rlfleet/rollout/sandbox_init.py rollout/rlfleet/rollout/envserver.py /opt/rlfleet/
WORKDIR /work
ENTRYPOINT ["python", "-I", "/opt/rlfleet/envsessions.py"]
