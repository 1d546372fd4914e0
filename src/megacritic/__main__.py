import sys

from megacritic.cli import main

# The guard matters: Megatron's distributed checkpointing starts worker processes that re-import __main__.
if __name__ == "__main__":
    sys.exit(main())
