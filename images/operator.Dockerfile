# The operator: control plane only, no torch. Build from the repository root:
#   docker build -f images/operator.Dockerfile -t ghcr.io/rlfleet/operator:0.1.0 .
FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml setup.py requirements/lock.txt ./
COPY core core
COPY operator operator
RUN pip install --no-cache-dir --prefix=/install \
      kopf==1.45.2 kubernetes==37.0.2 pydantic==2.14.3 pyyaml httpx prometheus-client==0.26.0 \
      opentelemetry-sdk opentelemetry-exporter-otlp-proto-http \
 && pip install --no-cache-dir --no-deps --prefix=/install .

FROM python:3.11-slim
COPY --from=build /install /usr/local
USER 65532:65532
ENTRYPOINT ["python", "-m", "rlfleet.operator"]
