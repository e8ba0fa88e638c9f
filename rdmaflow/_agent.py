"""What ``rdmaflow launch`` runs as torchrun: torch.distributed.run, with its failure written
as JSON to ``$RDMAFLOW_LAUNCH_REPORT`` instead of its 80-line ``ChildFailedError`` dump, so that
the launcher reports it in one line naming the rank, its role and the cause.

    python -m rdmaflow._agent [torchrun's arguments]
"""
from __future__ import annotations

import json
import logging
import os
import sys


def _report(path: str | None, doc: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(doc, f)


def _message(m) -> str:
    """A ProcessFailure's message: the error file's ``{"message": ...}`` or a string."""
    return str(m.get("message", m)) if isinstance(m, dict) else str(m)


def main(argv: list[str]) -> int:
    report = os.environ.pop("RDMAFLOW_LAUNCH_REPORT", None)  # the launcher's, not the ranks'
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    # Its banner (OMP_NUM_THREADS), its warnings on stopping the others ("Sending process ...
    # closing signal") and its error line per failure say again what the launcher's one line
    # says. Each of its loggers sets its own level: every one made by now is quieted.
    for name in list(logging.root.manager.loggerDict):
        if name.startswith(("torch.distributed.elastic", "torch.distributed.run")):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    try:
        torchrun.run(torchrun.parse_args(argv))
    except ChildFailedError as e:
        _report(report, {"failures": [{"rank": int(rank), "local_rank": f.local_rank, "exitcode": f.exitcode,
                               "message": _message(f.message) if f.error_file != "<N/A>" else None,
                               "timestamp": f.timestamp}
                              for rank, f in sorted(e.failures.items())]})
        return 1
    except SignalException as e:
        _report(report, {"signal": int(e.sigval)})
        return 128 + int(e.sigval)
    except Exception as e:  # noqa: BLE001 - the rendezvous's store timed out, or another agent error
        first = str(e).split("Exception raised from", 1)[0].strip().splitlines()  # c10d adds C++ frames
        _report(report, {"error": f"{type(e).__name__}: {first[0] if first else ''}"})
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
