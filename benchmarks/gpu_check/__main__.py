import sys

from benchmarks.gpu_check.registry import main

if __name__ == "__main__":
    sys.exit(main())
