# The trainer: DeepSpeed on CUDA. Build from the repository root:
#   docker build -f images/trainer.Dockerfile -t ghcr.io/rlfleet/trainer:0.1.0 .
# It installs the `trainer` dependency set, pinned by the lock (requirements/trainer.txt):
# PyPI's torch brings its CUDA libraries; the node brings the driver. The optimiser is
# torch's own AdamW, so no DeepSpeed op is compiled and no CUDA toolkit is needed.
FROM python:3.11-slim
WORKDIR /src
COPY requirements/trainer.txt requirements/trainer.txt
RUN pip install --no-cache-dir --no-deps -r requirements/trainer.txt
COPY pyproject.toml setup.py README.md ./
COPY core core
COPY trainer trainer
COPY weightsync weightsync
RUN pip install --no-cache-dir --no-deps . && pip check
USER 1000:1000
# The operator mounts the run's spec at /etc/rlfleet/rlrun.json and passes its path.
ENTRYPOINT ["python", "-m", "rlfleet.trainer"]
