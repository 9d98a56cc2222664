# vqueue on a CUDA host: vLLM's own image brings CUDA, torch and vLLM; we add the queue.
FROM vllm/vllm-openai:v0.26.0
ARG EXTRAS=gpu,flower,server
WORKDIR /app
# bubblewrap sandboxes codegen jobs' tests; inside a container it needs the rights to make
# namespaces (docs/quality.md; `vqueue worker --check` tells), else such jobs fail
# sandbox_unavailable
RUN apt-get update -qq && apt-get install -y -qq --no-install-recommends bubblewrap \
    && rm -rf /var/lib/apt/lists/*
COPY pyproject.toml README.md ./
COPY schemas schemas
COPY protocol protocol
COPY producer producer
COPY worker worker
COPY examples examples
RUN pip install --no-cache-dir -e ".[${EXTRAS}]"
ENTRYPOINT []
CMD ["vqueue", "--help"]
