# A sandbox pod of an EnvPool: the environment server and the tools agents use, nothing
# else; runs as nobody under the pool's runtimeClass (gVisor or Kata). Build from the root:
#   docker build -f images/env-sandbox.Dockerfile -t ghcr.io/rlfleet/env-sandbox:0.1.0 .
FROM python:3.11-slim
RUN apt-get update \
 && apt-get install -y --no-install-recommends git ca-certificates \
 && rm -rf /var/lib/apt/lists/*
COPY rollout/rlfleet/rollout/envserver.py /opt/rlfleet/envserver.py
WORKDIR /work
RUN chown 65534:65534 /work
USER 65534:65534
ENTRYPOINT ["python", "-I", "/opt/rlfleet/envserver.py"]
