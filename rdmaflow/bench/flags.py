"""The flags every ``rdmaflow bench`` command shares: one name and one meaning each.

A benchmark adds the ones it uses through these functions, so that ``--transport``, ``--systems``,
``--models``, ``--sizes``, ``--repeats``, ``--out``, ``--seed``, ``--threads``, ``--hosts``,
``--quick`` and ``-v`` read the same in every command. A list flag takes one or several values,
separated by spaces or commas (``--transport tcp sm`` and ``--transport tcp,sm`` are the same);
its value is a list without repeats, in the order given. The old spellings (``--model``,
``--system``, ``--csv``, ``--torch-threads``, ``--transport both``) still work, hidden from
``--help``, so that older command lines keep running.
"""
from __future__ import annotations

import argparse
from collections.abc import Sequence

TRANSPORTS = ("tcp", "sm")
HOSTS = ("local", "netns")
# The shared flags, for the test that walks every bench parser.
SHARED = ("--transport", "--systems", "--models", "--sizes", "--repeats", "--out", "--seed",
          "--threads", "--hosts", "--quick", "--verbose")


def split(values: Sequence[str] | str) -> list[str]:
    """``["tcp,sm", "tcp"]`` -> ``["tcp", "sm"]``: comma or space separated, repeats dropped."""
    if isinstance(values, str):
        values = [values]
    items = [x.strip() for v in values for x in str(v).split(",") if x.strip()]
    return list(dict.fromkeys(items))


class _ListAction(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, split(values))


def choose(values: Sequence[str], allowed: Sequence[str], flag: str) -> list[str]:
    """The values, checked against ``allowed``: ValueError naming the flag and the choices."""
    items = split(values)
    bad = [x for x in items if x not in allowed]
    if bad or not items:
        raise ValueError(f"{flag}: invalid choice {','.join(bad) or '(none)'!r} "
                         f"(choose from {', '.join(allowed)})")
    return items


def transports(values: Sequence[str], allowed: Sequence[str] = TRANSPORTS, *, one: bool = False) -> list[str]:
    """``--transport``'s value: ``both`` is ``tcp sm``; ``one``: a benchmark that runs one per run."""
    items = [t for v in split(values) for t in (TRANSPORTS if v == "both" else (v,))]
    items = choose(items, allowed, "--transport")
    if one and len(items) > 1:
        raise ValueError(f"--transport: this benchmark runs one transport per run; got {','.join(items)}: "
                         "run it once per transport")
    return items


def _list(ap: argparse.ArgumentParser, flag: str, default, help: str, metavar: str,
          aliases: Sequence[str] = ()) -> None:
    dest = flag.lstrip("-").replace("-", "_")
    ap.add_argument(flag, nargs="+", action=_ListAction, default=default, metavar=metavar, help=help)
    for old in aliases:  # hidden: older command lines keep working
        ap.add_argument(old, nargs="+", action=_ListAction, dest=dest, default=argparse.SUPPRESS,
                        help=argparse.SUPPRESS)


def _default_text(default) -> str:
    return ",".join(default) if isinstance(default, (list, tuple)) else str(default)


def add_transport(ap: argparse.ArgumentParser, default: Sequence[str] = TRANSPORTS, note: str = "",
                  allowed: Sequence[str] = TRANSPORTS) -> None:
    _list(ap, "--transport", list(default), metavar="T",
          help=f"UCX transports, one or several of {', '.join(allowed)} (default {_default_text(default)})"
               + (f"; {note}" if note else ""))


def add_systems(ap: argparse.ArgumentParser, default, allowed: Sequence[str] | str) -> None:
    names = allowed if isinstance(allowed, str) else ", ".join(allowed)
    _list(ap, "--systems", None if default is None else list(default), metavar="S",
          help=f"systems to run, one or several of {names} (default {'all' if default is None else _default_text(default)})",
          aliases=("--system",))


def add_models(ap: argparse.ArgumentParser, default: Sequence[str], allowed: str) -> None:
    _list(ap, "--models", list(default), metavar="M",
          help=f"models, one or several of {allowed} (default {_default_text(default)})", aliases=("--model",))


def add_sizes(ap: argparse.ArgumentParser, default: str | None, what: str) -> None:
    """``what`` names the sizes and their defaults, e.g. "tensor sizes (default 1K,1M)"."""
    ap.add_argument("--sizes", default=default, action=_SizesAction, nargs="+", metavar="SIZE",
                    help=f"{what}: bytes with K/M/G suffixes, one or several")


class _SizesAction(argparse.Action):
    # Kept as a comma string: the benchmarks' size parser reads "1K,64K".
    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, ",".join(split(values)))


def add_repeats(ap: argparse.ArgumentParser, default: int | None, what: str) -> None:
    """``what`` says what one repeat is and the default, e.g. "interleaved rounds (default 5)"."""
    ap.add_argument("--repeats", type=int, default=default, metavar="N", help=f"measurements per cell: {what}")


def add_out(ap: argparse.ArgumentParser, default: str | None, what: str) -> None:
    """``what`` lists the files and the default directory."""
    ap.add_argument("--out", default=default, metavar="DIR", help=f"directory of the results: {what}")


def add_seed(ap: argparse.ArgumentParser, what: str) -> None:
    ap.add_argument("--seed", type=int, default=0, help=f"random seed of {what} (default 0)")


def add_threads(ap: argparse.ArgumentParser, default: int | None, what: str) -> None:
    ap.add_argument("--threads", type=int, default=default, metavar="N",
                    help=f"torch intra-op threads per process ({what})")


def add_hosts(ap: argparse.ArgumentParser, what: str) -> None:
    ap.add_argument("--hosts", choices=HOSTS, default="local",
                    help=f"local: every process on this host (default); netns: {what} (needs root)")


def add_quick(ap: argparse.ArgumentParser, what: str) -> None:
    ap.add_argument("--quick", action="store_true", help=f"a smoke run, not a measurement: {what}")


def add_verbose(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("-v", "--verbose", action="store_true", help="print every measurement as it is taken")
