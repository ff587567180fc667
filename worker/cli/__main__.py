"""``python -m worker.cli`` is ``batchwork``."""

from worker.cli import main

if __name__ == "__main__":  # run, never on import
    main()
