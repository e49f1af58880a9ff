"""`python -m server serve ...` runs the OpenAI-compatible server: the `engine` command under another name."""

import sys

from engine.cli import main

if __name__ == "__main__":
    sys.exit(main())
