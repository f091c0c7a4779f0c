"""The ``fnaccel`` command line: Accelerate's subcommands and flags, same spellings.

Each subcommand lives in its own module with two functions:

- ``register(subparsers)`` adds its parser and sets ``handler=run`` on it;
- ``run(args) -> int`` does the work and returns the exit status.

`fnaccel.commands.main.main` dispatches and turns a `CommandError` or a
`ConfigError` into one line on stderr and exit status 2 (argparse's own
status for bad usage), never a traceback.
"""
