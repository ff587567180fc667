FROM python:3.11-slim
WORKDIR /app
# CPU build of torch by default; on a GPU host use the CUDA index instead.
RUN pip install --no-cache-dir torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
COPY pyproject.toml README.md alembic.ini ./
COPY worker worker
COPY api api
COPY migrations migrations
# Not editable: the image runs the package as a user would install it (migrations ship inside it).
RUN pip install --no-cache-dir .
ENV HF_HUB_OFFLINE=1
