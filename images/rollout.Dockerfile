# A rollout worker: vLLM (CUDA) and the agent harness. Build from the repository root:
#   docker build -f images/rollout.Dockerfile -t ghcr.io/rlfleet/rollout:0.1.0 .
# vLLM comes with the base image, the release `engine-cpu` pins for CPUs; the rest is the
# `rollout` dependency set, pinned by the lock (requirements/rollout.txt). `pip check`
# fails the build if the base's vLLM and the lock disagree.
FROM vllm/vllm-openai:v0.32.0
WORKDIR /src
COPY requirements/rollout.txt requirements/rollout.txt
RUN pip install --no-cache-dir --no-deps -r requirements/rollout.txt
COPY pyproject.toml setup.py README.md ./
COPY core core
COPY rollout rollout
COPY weightsync weightsync
RUN pip install --no-cache-dir --no-deps . && pip check
USER 1000:1000
ENTRYPOINT ["python", "-m", "rlfleet.rollout"]
