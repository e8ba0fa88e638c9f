"""What ``rdmaflow launch`` runs in each process of a job: the training script, as ``python
script.py args`` would, recording why it failed where the launcher reads it.

An exception that ends the script is printed as Python prints it, and its one-line summary
(``Type: message``) and time are written to ``$TORCHELASTIC_ERROR_FILE`` in the format of
torch's elastic ErrorHandler (torchrun sets that variable for each process; under
``--min-workers`` the launcher does): the launcher names the failed rank and this cause in one
line. Ctrl-C (KeyboardInterrupt) ends the process with status 130 and no traceback: the
launcher says once that the job was interrupted.

    python -m rdmaflow._rank script.py [its arguments]
    python -m rdmaflow._rank -m module [its arguments]    (as ``python -m module`` would)
"""
from __future__ import annotations

import json
import os
import runpy
import sys
import time
import traceback


def record(cause: str) -> None:
    """Writes ``cause`` where the launcher reads this process's failure (best effort)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    data = {"message": {"message": cause, "extraInfo": {"py_callstack": traceback.format_exc(),
                                                        "timestamp": str(int(time.time()))}}}
    try:
        with open(path, "w") as f:
            json.dump(data, f)
    except OSError:
        pass


def _from_script(tb, script: str | None):
    """The traceback from the script's first frame on (this module's and runpy's say nothing);
    for a module, from the first frame outside this module and runpy."""
    skip = {os.path.abspath(__file__), os.path.abspath(runpy.__file__)}
    t = tb
    while t is not None:
        f = os.path.abspath(t.tb_frame.f_code.co_filename)
        if (f == os.path.abspath(script)) if script else (f not in skip):
            return t
        t = t.tb_next
    return tb


def main(argv: list[str]) -> int:
    module = argv[1] if len(argv) > 1 and argv[0] == "-m" else None
    if not argv or (argv[0] == "-m" and module is None):
        print("usage: python -m rdmaflow._rank script.py|-m module [its arguments]", file=sys.stderr)
        return 2
    script = None if module else argv[0]
    try:
        if module:
            sys.argv = [module, *argv[2:]]  # run_module puts the module's path first, as `python -m` does
            sys.path[0] = os.getcwd()  # where `python -m` looks first
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            sys.path[0] = os.path.dirname(os.path.abspath(script))  # as `python script.py` sets it
            runpy.run_path(script, run_name="__main__")
    except KeyboardInterrupt:
        return 130
    except SystemExit as e:
        if e.code not in (None, 0) and not isinstance(e.code, int):
            record(str(e.code))  # sys.exit("message"): the message is the cause
        raise
    except BaseException as e:  # noqa: BLE001 - recorded, then reported as Python would
        record(f"{type(e).__name__}: {e}")
        traceback.print_exception(type(e), e, _from_script(e.__traceback__, script))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
