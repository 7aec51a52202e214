"""``python -m pipeline.bench``: the same as ``pipeline-bench``."""

from pipeline.bench.cli import main

if __name__ == "__main__":
    main()
