"""Every ``rdmaflow bench`` command takes the same flag names for the same things.

Walks the parser of each bench subcommand (and ``python -m rdmaflow.bench.perftest``'s): a
shared flag is spelled and parsed the same way everywhere, no command shows an old spelling
(``--model``, ``--system``, ``--csv``, ``--torch-threads``), and the old spellings still parse
into the new names so that older command lines keep running.
"""
from __future__ import annotations

import argparse

import pytest

from rdmaflow import cli
from rdmaflow.bench import flags

OLD = ("--model", "--system", "--csv", "--torch-threads")


def _bench_parsers() -> dict[str, argparse.ArgumentParser]:
    ap = cli.build_parser()
    sub = next(a for a in ap._actions if isinstance(a, argparse._SubParsersAction))
    bench = sub.choices["bench"]
    bsub = next(a for a in bench._actions if isinstance(a, argparse._SubParsersAction))
    parsers = dict(bsub.choices)
    for name, p in parsers.items():
        assert p.get_default("_module") is not None, f"bench {name} failed to load: {p.get_default('_broken')}"
    return parsers


def _options(p: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {o: a for a in p._actions for o in a.option_strings}


def _shape(a: argparse.Action) -> tuple:
    """What a flag means to the parser: its destination, how many values, their type and action."""
    return (a.dest, a.nargs, a.type, type(a).__name__, a.metavar, a.choices)


def test_every_bench_command_loads_and_shares_the_flag_vocabulary():
    parsers = _bench_parsers()
    assert set(parsers) == set(cli.BENCHMARKS)
    shapes: dict[str, dict[str, tuple]] = {}
    for name, p in parsers.items():
        opts = _options(p)
        for flag in ("--transport", "--out"):  # every benchmark has these
            assert flag in opts, f"bench {name} has no {flag}"
        for flag in flags.SHARED:
            if flag in opts:
                shapes.setdefault(flag, {})[name] = _shape(opts[flag])
        for old in OLD:  # an old spelling is hidden where it is kept at all
            if old in opts:
                assert opts[old].help == argparse.SUPPRESS, f"bench {name} shows {old}"
    for flag, by_command in shapes.items():
        assert len(set(by_command.values())) == 1, f"{flag} differs between benchmarks: {by_command}"
    assert {f for f in shapes} >= {"--transport", "--systems", "--models", "--sizes", "--repeats", "--out",
                                   "--seed", "--threads", "--hosts", "--quick", "--verbose"}


def test_help_texts_say_the_same_thing():
    for name, p in _bench_parsers().items():
        opts = _options(p)
        assert opts["--transport"].help.startswith("UCX transports, one or several of"), name
        if "--repeats" in opts:  # bench train times iterations of one job per cell instead
            assert opts["--repeats"].help.startswith("measurements per cell:"), name
        assert opts["--out"].help.startswith("directory of the results:"), name
        if "--sizes" in opts:
            assert "bytes with K/M/G suffixes, one or several" in opts["--sizes"].help, name
        help_text = p.format_help()
        for old in OLD:
            assert f"{old} " not in help_text.replace(f"{old}s ", ""), f"bench {name} --help shows {old}"


@pytest.mark.parametrize("argv", [["--transport", "tcp", "sm"], ["--transport", "tcp,sm"],
                                  ["--transport", "sm,tcp", "tcp"], ["--transport", "both"]])
def test_transport_takes_one_or_several_the_same_way_everywhere(argv):
    for name, p in _bench_parsers().items():
        got = flags.transports(p.parse_args(argv).transport, (*flags.TRANSPORTS, "cuda"))
        assert sorted(got) == ["sm", "tcp"], (name, argv, got)


def test_list_flags_and_old_spellings_parse_into_the_new_names():
    parsers = _bench_parsers()
    assert parsers["train"].parse_args(["--model", "fcn5", "vgg19"]).models == ["fcn5", "vgg19"]
    assert parsers["train"].parse_args(["--models", "fcn5,vgg19"]).models == ["fcn5", "vgg19"]
    assert parsers["train"].parse_args(["--system", "rdmaflow", "ddp"]).systems == ["rdmaflow", "ddp"]
    assert parsers["pipeline"].parse_args(["--models", "comm", "varlen"]).models == ["comm", "varlen"]
    assert parsers["latency"].parse_args(["--systems", "rdmaflow,gloo"]).systems == ["rdmaflow", "gloo"]
    assert parsers["converge"].parse_args(["--systems", "ddp", "rdmaflow"]).systems == ["ddp", "rdmaflow"]
    assert parsers["transfer"].parse_args(["--sizes", "1K", "64K,1M"]).sizes == "1K,64K,1M"
    assert parsers["transfer"].parse_args(["--torch-threads", "2"]).threads == 2
    assert parsers["transfer"].parse_args([]).threads == 1
    dev = parsers["device"].parse_args(["--csv", "x.csv"])
    assert dev.csv == "x.csv" and dev.out == "bench-results"


def test_bad_values_name_the_flag_and_the_choices():
    with pytest.raises(ValueError, match=r"--transport: invalid choice 'ib' \(choose from tcp, sm\)"):
        flags.transports(["ib"])
    with pytest.raises(ValueError, match="one transport per run"):
        flags.transports(["tcp", "sm"], one=True)
    with pytest.raises(ValueError, match=r"--systems: invalid choice 'mpi'"):
        flags.choose(["rdmaflow,mpi"], ("rdmaflow", "gloo"), "--systems")


def test_perftest_takes_the_same_flags():
    from rdmaflow.bench import perftest

    assert perftest.main(["--transport", "ib"]) == 2
    assert perftest.main(["--transport", "tcp", "sm"]) == 2
