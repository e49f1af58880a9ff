"""`python -m server serve ...` runs the OpenAI-compatible server (same as `engine serve`)."""

import sys

from server.cli import main

if __name__ == "__main__":
    sys.exit(main())
