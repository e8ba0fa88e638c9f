"""What scripts/setup.sh and scripts/wheelhouse.sh install, read from pyproject.toml (standard
library only; run it with the interpreter it is about, from any directory).

    requirements.py ucx-wheel [CHOICE]   the libucx wheel: CHOICE (cu12, cu13, libucx-cu13, ...)
                                         or, without one, the one for the PyTorch this interpreter
                                         imports (torch.version.cuda; cu12 without PyTorch or CUDA)
    requirements.py extra WHEEL          the pyproject extra that installs WHEEL (cu13)
    requirements.py build-system         [build-system].requires
    requirements.py runtime EXTRAS       [project].dependencies and those of EXTRAS (a, b),
                                         without torch and the libucx wheels

The choice of wheel by CUDA version is rdmaflow/_ucx.py's (``wheel_for_cuda``), loaded from
its file: the package itself may not be built yet.
"""
from __future__ import annotations

import importlib.util
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _pyproject() -> dict:
    try:
        import tomllib
    except ImportError:  # Python 3.10: pip carries tomli
        from pip._vendor import tomli as tomllib
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)


def _ucx_module():
    spec = importlib.util.spec_from_file_location("_rdmaflow_ucx", os.path.join(ROOT, "rdmaflow", "_ucx.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _name(req: str) -> str:
    return re.split(r"[\s<>=!~;\[(]", req.strip(), maxsplit=1)[0].lower().replace("_", "-")


def ucx_wheel(choice: str | None) -> str:
    ucx = _ucx_module()
    if choice:
        return ucx.wheel_name(choice)
    try:
        import torch
    except ImportError:
        return ucx.DEFAULT_WHEEL
    return ucx.wheel_for_cuda(torch.version.cuda)


def extra(wheel: str) -> str:
    extras = _pyproject()["project"]["optional-dependencies"]
    for name, reqs in extras.items():
        if [_name(r) for r in reqs] == [wheel]:
            return name
    raise SystemExit(f"requirements.py: no extra in pyproject.toml installs {wheel}")


def runtime(extras: list[str]) -> list[str]:
    project = _pyproject()["project"]
    reqs = list(project["dependencies"])
    for e in extras:
        reqs += project["optional-dependencies"][e]
    out: list[str] = []
    for r in reqs:
        if _name(r) != "torch" and not _name(r).startswith("libucx-") and r not in out:
            out.append(r)
    return out


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    cmd, args = argv[0], argv[1:]
    if cmd == "ucx-wheel":
        try:
            print(ucx_wheel(args[0] if args else None))
        except ValueError as e:
            raise SystemExit(f"requirements.py: {e}") from None
    elif cmd == "extra":
        print(extra(args[0]))
    elif cmd == "build-system":
        print("\n".join(_pyproject()["build-system"]["requires"]))
    elif cmd == "runtime":
        print("\n".join(runtime([e for e in (args[0] if args else "").split(",") if e])))
    else:
        print(__doc__, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
