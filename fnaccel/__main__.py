"""``python -m fnaccel``: the same command line as the ``fnaccel`` script."""

import sys

from fnaccel.commands.main import main

if __name__ == "__main__":
    sys.exit(main())
