"""`python -m megatron_lorafusion ...` is the `lorafusion` command."""

import signal
import sys

from megatron_lorafusion.lifetime import StopSignals, Terminated, note_command_start


def run() -> int:
    """The `lorafusion` program: `cli.main` with SIGINT and SIGTERM handled from the start.

    The handler goes in before the imports (a second under load), so a Ctrl-C there, or
    while the arguments are parsed, ends with one line too. Once ``main`` returns both
    signals are ignored: the interpreter's exit hooks (joining child processes, torch's
    clean-up) run after it, and a Ctrl-C there would print a traceback of whichever hook it
    hit, with nothing left to stop.
    """
    note_command_start()
    stops = StopSignals()
    stops.install()
    try:
        from megatron_lorafusion.cli import main

        return main()
    except KeyboardInterrupt as stop:  # before main's own handler: the same one line
        stops.done = True
        terminated = isinstance(stop, Terminated)
        sys.stderr.write(f"{'terminated' if terminated else 'interrupted'}: lorafusion stopped\n")
        return 128 + (signal.SIGTERM if terminated else signal.SIGINT)
    finally:
        stops.done = True
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, signal.SIG_IGN)


if __name__ == "__main__":
    raise SystemExit(run())
