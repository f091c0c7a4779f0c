"""``python -m fnaccel``: the same command line as the ``fnaccel`` script."""

from fnaccel.commands.main import console_main

if __name__ == "__main__":
    console_main()
