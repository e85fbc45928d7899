# One image for every service role: api (`kernelcrew serve`), orchestrator and GPU worker.
# The CUDA runtime base lets the worker run Triton and CUDA extensions; the API and orchestrators
# use the same image and simply never touch the GPU.
FROM nvidia/cuda:12.8.1-devel-ubuntu24.04
ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1 \
    KERNELCREW_DATA_DIR=/data KERNELCREW_CACHE_DIR=/cache
# bubblewrap isolates every evaluation of user code (KERNELCREW_SANDBOX=bwrap): it needs user
# namespaces, which Docker's default seccomp profile refuses; see docker-compose.yml's security_opt.
RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-venv python3-dev \
    build-essential bubblewrap && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/kc
ENV PATH=/opt/kc/bin:$PATH
WORKDIR /src
COPY pyproject.toml README.md ./
COPY kernelcrew ./kernelcrew
RUN pip install .
RUN useradd --create-home kc && mkdir -p /data /cache && chown kc /data /cache
USER kc
ENTRYPOINT ["kernelcrew"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000", "--orchestrators", "0"]
