# The trainer: DeepSpeed on CUDA. Build from the repository root:
#   docker build -f images/trainer.Dockerfile -t ghcr.io/rlfleet/trainer:0.1.0 .
FROM nvcr.io/nvidia/pytorch:25.10-py3
WORKDIR /src
COPY pyproject.toml setup.py ./
COPY requirements requirements
COPY core core
COPY trainer trainer
COPY weightsync weightsync
RUN pip install --no-cache-dir deepspeed==0.19.8 nats-py==2.16.0 zstandard==0.25.0 \
      xxhash==4.1.0 msgspec==0.22.0 safetensors pydantic==2.14.3 prometheus-client==0.26.0 \
 && pip install --no-cache-dir --no-deps .
USER 1000:1000
# The operator mounts the run's spec at /etc/rlfleet/rlrun.json and passes its path.
ENTRYPOINT ["python", "-m", "rlfleet.trainer"]
