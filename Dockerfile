# tierkv-server: the gRPC cache server (cpu + disk tiers, optional Redis), no GPU needed.
#   docker build -t tierkv-server . && docker compose up
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
WORKDIR /app

# A CPU torch first, so the project's dependency on torch does not pull a CUDA build.
RUN pip install --index-url https://download.pytorch.org/whl/cpu "torch>=2.4"

# The parts are listed once, in pyproject.toml; .dockerignore leaves out what is not installed.
COPY . .
RUN pip install . "vllm-router==0.1.17"

RUN useradd --system --uid 10001 tierkv && mkdir -p /var/cache/tierkv && chown tierkv /var/cache/tierkv
USER tierkv
VOLUME /var/cache/tierkv

# Inside a container the server must listen on all interfaces; publish the port with care.
ENV TIERKV_HOST=0.0.0.0 TIERKV_PORT=50051 TIERKV_CACHE_DIR=/var/cache/tierkv TIERKV_METRICS_PORT=9400
EXPOSE 50051 9400
HEALTHCHECK --interval=10s --timeout=5s --start-period=20s --retries=3 \
  CMD ["tierkv-server", "health", "--target", "127.0.0.1:50051"]
ENTRYPOINT ["tierkv-server"]
