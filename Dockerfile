# vqueue on a CUDA host: vLLM's own image brings CUDA, torch and vLLM; we add the queue.
FROM vllm/vllm-openai:v0.26.0
ARG EXTRAS=gpu,flower,server
WORKDIR /app
COPY pyproject.toml README.md ./
COPY schemas schemas
COPY protocol protocol
COPY producer producer
COPY worker worker
COPY examples examples
RUN pip install --no-cache-dir -e ".[${EXTRAS}]"
ENTRYPOINT []
CMD ["vqueue", "--help"]
