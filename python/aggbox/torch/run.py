"""Runs a PyTorch script with the backend "aggbox" registered:

    python -m aggbox.torch.run script.py ARGS...
    python -m aggbox.torch.run -m package.module ARGS...
    torchrun --nproc_per_node 4 -m aggbox.torch.run script.py --dist-backend aggbox

imports ``aggbox.torch`` (which registers the backend), then runs the script
(or module) as ``__main__`` with ``sys.argv`` = [script, ARGS...], as
``python script.py ARGS`` would: a script that takes its backend's name
needs nothing else changed. Processes the script starts itself with
``multiprocessing`` "spawn" (``torch.multiprocessing.spawn``) import only
what the script imports, so there the backend is unknown: run one process per
rank (torchrun, or the script's own per-rank mode) instead.
"""

import runpy
import sys

USAGE = "usage: python -m aggbox.torch.run (SCRIPT.py | -m MODULE) [ARGS...]"


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, file=sys.stderr)
        sys.exit(0 if argv else 2)
    import aggbox.torch  # noqa: F401 - registers the backend

    if argv[0] == "-m":
        if len(argv) < 2:
            print(USAGE, file=sys.stderr)
            sys.exit(2)
        sys.argv = [argv[1]] + argv[2:]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = argv
        # The script's directory first on the path, as `python script.py` has it.
        import os

        sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
        runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
