# syntax=docker/dockerfile:1.7
# One image, three roles: the command picks draft, target or coordinator.
#
#   docker build -t specserve:cpu .                                   # CPU (default)
#   docker build --build-arg TORCH_VARIANT=cu128 -t specserve:cu128 .  # CUDA 12.8 wheels
#
# Models are not baked in: mount a checkpoint directory at /models. On a GPU the model services take the
# device flags (docs/gpu.md), e.g.
#
#   docker run --gpus all -v "$PWD/models:/models:ro" specserve:cu128 serve target --host 0.0.0.0 --device cuda --dtype bfloat16 --model /models/default/target
#
# (with --device cuda the attention backend defaults to Triton and the window steps run as CUDA graphs).
#
# BASE_IMAGE is used by both stages (the builder's venv is copied as is, so the runtime must have the same
# Python at the same path). The cu128 torch wheels bring their own CUDA runtime libraries, so the slim
# Python base also serves GPUs (the host provides the driver through the NVIDIA container toolkit).
ARG BASE_IMAGE=python:3.11-slim-bookworm

FROM ${BASE_IMAGE} AS builder
ARG TORCH_VARIANT=cpu
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/${TORCH_VARIANT}
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
RUN python -m venv /opt/specserve
ENV PATH=/opt/specserve/bin:${PATH}
# torch first, from the index of the chosen variant; `pip install .` then finds torch==2.13.0 satisfied.
RUN pip install --upgrade pip \
 && pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"
WORKDIR /src
COPY pyproject.toml README.md ./
COPY specserve ./specserve
COPY engine ./engine
COPY kernels ./kernels
COPY serving ./serving
COPY draft_service ./draft_service
COPY target_service ./target_service
COPY coordinator ./coordinator
COPY deployment ./deployment
COPY bench ./bench
RUN pip install . \
 && python -c "import torch, grpc_health, specserve.cli; print('torch', torch.__version__)"

FROM ${BASE_IMAGE} AS runtime
ARG TORCH_VARIANT=cpu
# Triton compiles a small launcher with the system C compiler at run time: only the GPU variant needs one.
RUN if [ "${TORCH_VARIANT}" != "cpu" ]; then \
      apt-get update \
      && apt-get install -y --no-install-recommends gcc libc6-dev \
      && rm -rf /var/lib/apt/lists/*; \
    fi \
 && groupadd --system --gid 10001 specserve \
 && useradd --system --uid 10001 --gid specserve --home-dir /home/specserve --create-home \
      --shell /usr/sbin/nologin specserve \
 && mkdir -p /models
COPY --from=builder /opt/specserve /opt/specserve
ENV PATH=/opt/specserve/bin:${PATH} \
    PYTHONUNBUFFERED=1 \
    HOME=/home/specserve \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    SPECSERVE_HEALTH_PORT=50050
USER 10001:10001
WORKDIR /home/specserve
# coordinator, draft, target (gRPC) and Prometheus metrics
EXPOSE 50050 50051 50052 9464
# grpc.health.v1 Check of the whole server on 127.0.0.1:$SPECSERVE_HEALTH_PORT (set it to the role's --port);
# with SPECSERVE_TLS_CERT/_KEY/_CA set it checks over (mutual) TLS, expecting SPECSERVE_TLS_SERVER_NAME.
HEALTHCHECK --interval=15s --timeout=10s --start-period=300s --retries=3 \
  CMD ["python", "-c", "import os,sys,grpc;from grpc_health.v1 import health_pb2 as h,health_pb2_grpc as g;e=os.environ.get;r=lambda p:open(p,'rb').read() if p else None;a='127.0.0.1:'+e('SPECSERVE_HEALTH_PORT','50050');c=grpc.secure_channel(a,grpc.ssl_channel_credentials(r(e('SPECSERVE_TLS_CA')),r(e('SPECSERVE_TLS_KEY')),r(e('SPECSERVE_TLS_CERT'))),[('grpc.ssl_target_name_override',e('SPECSERVE_TLS_SERVER_NAME','localhost'))]) if e('SPECSERVE_TLS_CERT') else grpc.insecure_channel(a);s=g.HealthStub(c).Check(h.HealthCheckRequest(),timeout=float(e('SPECSERVE_HEALTH_TIMEOUT','5'))).status;sys.exit(0 if s==h.HealthCheckResponse.SERVING else 1)"]
ENTRYPOINT ["specserve"]
CMD ["serve", "coordinator", "--host", "0.0.0.0", "--port", "50050", "--target", "target:50052", "--draft", "draft:50051", "--metrics-port", "9464"]
