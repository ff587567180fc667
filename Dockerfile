FROM python:3.11-slim
WORKDIR /app
# CPU build of torch by default; on a GPU host use the CUDA index instead.
RUN pip install --no-cache-dir torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
COPY pyproject.toml README.md alembic.ini ./
COPY worker worker
COPY api api
COPY migrations migrations
RUN pip install --no-cache-dir -e .
ENV HF_HUB_OFFLINE=1
