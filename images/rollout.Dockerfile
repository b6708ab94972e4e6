# A rollout worker: vLLM (CUDA) and the agent harness. Build from the repository root:
#   docker build -f images/rollout.Dockerfile -t ghcr.io/rlfleet/rollout:0.1.0 .
FROM vllm/vllm-openai:v0.32.0
WORKDIR /src
COPY pyproject.toml setup.py ./
COPY core core
COPY rollout rollout
COPY weightsync weightsync
RUN pip install --no-cache-dir nats-py==2.16.0 zstandard==0.25.0 xxhash==4.1.0 \
      msgspec==0.22.0 pydantic==2.14.3 prometheus-client==0.26.0 httpx \
 && pip install --no-cache-dir --no-deps .
USER 1000:1000
ENTRYPOINT ["python", "-m", "rlfleet.rollout"]
