"""``python -m worker.cli`` is ``batchwork``."""

from worker.cli import main

main()
