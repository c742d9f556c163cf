"""``python -m backward_doctor FILE.py [--timeout S] [--memory-limit SIZE] [--json OUT]``."""
import sys

from .frontends.cli import main

if __name__ == "__main__":
    sys.exit(main())
