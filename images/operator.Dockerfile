# The operator: control plane only, no torch. Build from the repository root:
#   docker build -f images/operator.Dockerfile -t ghcr.io/rlfleet/operator:0.1.0 .
# It installs the `operator` dependency set, pinned by the lock (requirements/operator.txt).
FROM python:3.11-slim AS build
WORKDIR /src
COPY requirements/operator.txt requirements/operator.txt
RUN pip install --no-cache-dir --prefix=/install --no-deps -r requirements/operator.txt
COPY pyproject.toml setup.py README.md ./
COPY core core
COPY operator operator
RUN pip install --no-cache-dir --no-deps --prefix=/install .

FROM python:3.11-slim
COPY --from=build /install /usr/local
USER 65532:65532
ENTRYPOINT ["python", "-m", "rlfleet.operator"]
