"""``rdmaflow bench kv --sparse``: pulls and pushes of Zipf-distributed keys from an embedding
table, rdmaflow's ``SparseTable`` next to the declared ``KVStore`` and a dictionary-of-rows
server over TensorPipe RPC and gRPC.

A cell is (transport, rows, dim). Per cell every system holds rows 0..rows-1 of ``dim``
float32, all present, and times ``--keys`` keys per request (4,096 by default) drawn from a
Zipf distribution (``--zipf``, default exponent 1.1; hot ids scattered over the table): a pull
(the rows returned), then a push (added to the rows) of the same requests. Systems
(``_kv_sparse_worker.py`` holds them; each cell starts its processes afresh):

    sparse-read      SparseTable pull by one-sided READs of the shard's hash table
    sparse-request   SparseTable pull by one batched request per shard
    declared         KVStore declaring keys 0..rows-1, batched form (duplicates merged first)
    tensorpipe-dict  dict of row id -> tensor on a server, torch.distributed.rpc (TensorPipe)
    grpc-dict        the same over gRPC (tcp: loopback TCP; sm: a unix domain socket)

The systems of a cell run at once and are measured in interleaved repeats (the order rotating):
a repeat is ``--warmup`` untimed pulls and pushes, then ``--iters`` timed pulls and ``--iters``
timed pushes, every system the same requests and values. A cell's figure is the median over
every timed call, its spread p10-p90. After the repeats every system pulls the same check keys:
their rows must be equal (the values are small integers, exact however duplicates are summed).
Over tcp ``ucx_perftest ucp_get`` at the row size (32 gets in flight) is the READ path's
ceiling. A system whose estimated memory (:func:`footprint`) exceeds ``--max-memory`` is
reported n/a at that size, with the estimate.
"""
from __future__ import annotations

import argparse
import contextlib
import math
import os
import statistics
import sys
import tempfile
import time

from rdmaflow.bench import harness as h
from rdmaflow.bench import processes

SYSTEMS = ("sparse-read", "sparse-request", "declared", "tensorpipe-dict", "grpc-dict")
SPARSE = ("sparse-read", "sparse-request")
RPC = ("tensorpipe-dict", "grpc-dict")
SHORT = {"sparse-read": "read", "sparse-request": "req", "declared": "decl", "tensorpipe-dict": "tp",
         "grpc-dict": "grpc"}
# The processes that hold the systems: a group starts once per cell for those of its systems that
# run together (a system that does not fit --max-memory beside the others of its group runs alone).
GROUPS = {"sparse": SPARSE, "declared": ("declared",), "dict": RPC}
OPS = ("pull", "push")
DEFAULT_ROWS, QUICK_ROWS = "100000,1000000", "10000"
DEFAULT_DIMS, QUICK_DIMS = "16,64", "16"
DEFAULT_KEYS = 4096
# The targets at BAR_ROWS rows, pull of present keys: (most time over the declared pull, least speedup over RPC).
BARS = {"sm": (1.5, 10.0), "tcp": (1.0, 10.0)}
BAR_ROWS = 1_000_000
CSV_COLUMNS = ("transport", "system", "rows", "dim", "keys", "op", "status", "median_ms", "p10_ms", "p90_ms",
               "iqr_ms", "min_ms", "max_ms", "calls", "unique_keys", "vs_declared", "speedup_vs_tensorpipe",
               "speedup_vs_grpc", "values", "note")
# Bytes per row beyond its values (measured at 10^6 rows: rdmaflow/bench/README.md, "bench kv --sparse").
DICT_ROW_OVERHEAD = 520      # a dict entry and a small tensor of its own: 513 B
DECLARED_KEY_OVERHEAD = 700  # the declaration as Python lists, its JSON and the layout, in each process: 278 B + JSON


def footprint(system: str, rows: int, dim: int) -> int:
    """Estimated bytes a system's processes hold for a table of rows x dim float32."""
    v = rows * dim * 4
    if system == "declared":  # shard: the values, a push area and a reply area, each the whole table;
        return 5 * v + 2 * rows * (16 + DECLARED_KEY_OVERHEAD)  # worker: a push stage and a landing area
    if system in SPARSE:  # entries of version, key, check and the row + 16 B of bucket keys a slot
        return 3 * rows * (24 + 8 * math.ceil(dim * 4 / 8) + 16)
    return v + rows * DICT_ROW_OVERHEAD  # a dictionary server's rows


WHY = {"declared": "5x the values: the shard's values, push and reply areas, the worker's push stage and landing "
                   "area; and the declaration, ~700 B a key in each process",
       "sparse-read": "3 hash-table entries a row: up to 2x the rows in slots, and growth's old and new regions",
       "tensorpipe-dict": "the values and ~520 B a row: a dict entry and a tensor of its own"}
WHY["sparse-request"], WHY["grpc-dict"] = WHY["sparse-read"], WHY["tensorpipe-dict"]


def mem_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 << 30


def _ints(text: str, flag: str) -> list[int]:
    try:
        vals = sorted({int(float(x)) for x in str(text).split(",") if x.strip()})
    except ValueError:
        raise ValueError(f"{flag} takes integers (1e6 and 1000000 are the same), got {text!r}") from None
    if not vals or vals[0] < 1:
        raise ValueError(f"{flag} must be >= 1, got {text!r}")
    return vals


def sparse_available() -> str:
    """"" where ``rdmaflow.ps.SparseTable`` exists, else why not."""
    from rdmaflow import ps

    return "" if hasattr(ps, "SparseTable") else "SparseTable is not in this build of rdmaflow.ps"


# -- a group's processes ---------------------------------------------------------------------------
class Group:
    """The processes of one group in one cell; ``host`` answers the commands for its systems."""

    def __init__(self, name: str, systems: list[str], transport: str, rows: int, dim: int,
                 args: argparse.Namespace) -> None:
        self.name, self.systems = name, systems
        self.procs: list[processes.ChildProcess] = []
        self.store = None
        self.sock_dir = None
        self.info: dict = {}
        worker = [sys.executable, "-m", "rdmaflow.bench._kv_sparse_worker", "--transport", transport,
                  "--rows", str(rows), "--dim", str(dim), "--keys", str(args.keys), "--zipf", str(args.zipf),
                  "--seed", str(args.seed), "--timeout", str(args.timeout)]
        env = processes.process_env(transport, secret=processes.new_secret(), threads=1)
        try:
            if name in ("sparse", "declared"):
                import torch.distributed as dist

                self.store = dist.TCPStore("127.0.0.1", 0, 2, True, wait_for_workers=False)
                for rank, label in enumerate(("shard", "worker")):
                    # The shard waits in the store while the worker builds a declaration of every row
                    # (~30 us a key on a loaded machine): ps.init's store timeout grows with the rows.
                    e = dict(env, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2",
                             GROUP_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(self.store.port),
                             RDMAFLOW_SHARDS_PER_NODE="1", TORCHELASTIC_USE_AGENT_STORE="True",
                             RDMAFLOW_PS_TIMEOUT=str(round(args.timeout + rows / 5e3)))
                    self.procs.append(processes.ChildProcess(
                        [*worker, "--role", "rdmaflow", "--system", ",".join(systems)], e, f"{name} {label}",
                        stdin=rank == 1))
            else:
                self.sock_dir = tempfile.mkdtemp(prefix="rdmaflow-kv-")
                # gRPC's address is chosen here, so that server and client start at once
                target = (f"unix:{os.path.join(self.sock_dir, 'grpc.sock')}" if transport == "sm"
                          else f"127.0.0.1:{processes.free_port()}")
                common = [*worker, "--system", ",".join(systems), "--port", str(processes.free_port()),
                          "--target", target]
                for role in ("server", "client"):
                    self.procs.append(processes.ChildProcess([*common, "--role", f"dict-{role}"], env, f"dict {role}"))
            self.host = self.procs[-1]
        except BaseException:
            self.close()
            raise

    def ready(self, timeout: float) -> dict:
        msg = self.host.read(timeout)
        self.info = msg
        return msg

    def ask(self, cmd: dict, timeout: float) -> dict:
        self.host.send(cmd)
        return self.host.read(timeout)

    def close(self) -> None:
        for p in self.procs:  # every one told first: TensorPipe's graceful shutdown waits for both ends
            if p.poll() is None and p.proc.stdin is not None:
                with contextlib.suppress(processes.BenchError):
                    p.send({"cmd": "exit"})
        for p in reversed(self.procs):
            p.close(grace=10.0)
        if self.sock_dir:
            import shutil

            shutil.rmtree(self.sock_dir, ignore_errors=True)


# -- the run ---------------------------------------------------------------------------------------
class Results:
    """cells[(transport, rows, dim, system)] = {"status", "note", "pull": [ms], "push": [ms], ...}."""

    def __init__(self) -> None:
        self.cells: dict[tuple, dict] = {}
        self.perftest: dict[tuple, dict] = {}  # (transport, dim) -> {"gets_per_s": [...], ...}
        self.values: dict[tuple, str] = {}  # (transport, rows, dim) -> agree / differ: ...

    def cell(self, transport: str, rows: int, dim: int, system: str) -> dict:
        return self.cells.setdefault((transport, rows, dim, system),
                                     {"status": "ok", "note": "", "pull": [], "push": []})

    def na(self, transport, rows, dim, system, why: str, status: str = "n/a") -> None:
        c = self.cell(transport, rows, dim, system)
        c["status"], c["note"] = status, why

    def median(self, transport, rows, dim, system, op) -> float | None:
        c = self.cells.get((transport, rows, dim, system))
        return statistics.median(c[op]) if c and c["status"] == "ok" and c[op] else None


def plan(systems: list[str], rows: int, dim: int, budget: int, res: Results, transport: str,
         no_sparse: str) -> list[list[tuple[str, list[str]]]]:
    """The groups that run at this size, packed into batches that fit ``budget`` together (a
    batch's systems run at once, interleaved); the others recorded n/a with the reason."""
    groups = []
    for g, members in GROUPS.items():
        mine = [s for s in members if s in systems]
        if g == "sparse" and no_sparse:
            for s in mine:
                res.na(transport, rows, dim, s, no_sparse)
            continue
        fits = []
        for s in mine:
            need = footprint(s, rows, dim)
            if need > budget:
                res.na(transport, rows, dim, s, f"needs about {need / 2**30:.1f} GiB at {rows:,} x {dim} "
                       f"({WHY[s]}), more than --max-memory {budget / 2**30:.1f} GiB")
            else:
                fits.append(s)
        together = sum(footprint(s, rows, dim) for s in fits)
        if fits and together <= budget:
            groups.append((g, fits, together))
        else:  # one at a time
            groups += [(g, [s], footprint(s, rows, dim)) for s in fits]
    batches: list[list[tuple[str, list[str]]]] = []
    used: list[int] = []
    for g, mine, need in groups:  # first fit
        for i, u in enumerate(used):
            if u + need <= budget:
                batches[i].append((g, mine))
                used[i] += need
                break
        else:
            batches.append([(g, mine)])
            used.append(need)
    return batches


def run_batch(batch: list[tuple[str, list[str]]], transport: str, rows: int, dim: int,
              args: argparse.Namespace, res: Results) -> None:
    ready_timeout = 120.0 + args.timeout + rows / 4e3  # past the jobs' store timeout (Group)
    call_timeout = args.timeout + 2.0 * (args.iters + args.warmup)
    groups: dict[str, Group] = {}
    owner: dict[str, Group] = {}
    try:
        for g, mine in batch:
            try:
                groups[g] = Group(g, mine, transport, rows, dim, args)
            except processes.BenchError as e:
                for s in mine:
                    res.na(transport, rows, dim, s, f"did not start: {processes.one_line(str(e))}", "failed")
        for g, grp in groups.items():
            t0 = time.monotonic()
            try:
                msg = grp.ready(ready_timeout)
            except processes.BenchError as e:
                for s in grp.systems:
                    res.na(transport, rows, dim, s, f"setup failed: {processes.one_line(str(e))}", "failed")
                continue
            for s in grp.systems:
                c = res.cell(transport, rows, dim, s)
                c["unique"], c["setup_s"] = msg.get("unique"), time.monotonic() - t0
                c["info"] = msg.get("info", {})
                owner[s] = grp
            if args.verbose:
                print(f"  {transport} {rows:,}x{dim} {g}: ready in {time.monotonic() - t0:.1f} s", flush=True)
        live = [s for s in SYSTEMS if s in owner]
        start = dict.fromkeys(live, 0)
        for r in range(args.repeats):
            k = r % max(1, len(live))
            for s in live[k:] + live[:k]:
                c = res.cell(transport, rows, dim, s)
                if c["status"] != "ok":
                    continue
                try:
                    msg = owner[s].ask({"cmd": "measure", "system": s, "start": start[s], "iters": args.iters,
                                        "warmup": args.warmup}, call_timeout)
                except processes.BenchError as e:
                    res.na(transport, rows, dim, s, f"failed in repeat {r}: {processes.one_line(str(e))}", "failed")
                    continue
                start[s] = msg["next"]
                c["pull"] += msg["pull"]
                c["push"] += msg["push"]
                if msg.get("stats") is not None:
                    st = c.setdefault("stats", {"pulls": 0})
                    st["pulls"] += msg["pulls"]
                    for key, v in msg["stats"].items():
                        st[key] = st.get(key, 0) + v
                if args.verbose:
                    print(f"  {transport} {rows:,}x{dim} {s} repeat {r}: pull "
                          f"{statistics.median(msg['pull']):.3g} ms, push {statistics.median(msg['push']):.3g} ms",
                          flush=True)
        for s in live:
            c = res.cell(transport, rows, dim, s)
            if c["status"] == "ok":
                try:
                    c["check"] = owner[s].ask({"cmd": "check", "system": s}, call_timeout)
                except processes.BenchError as e:
                    c["check_error"] = processes.one_line(str(e))
    finally:
        for grp in groups.values():
            grp.close()


def compare_values(res: Results, transport: str, rows: int, dim: int) -> str:
    """"agree" when every system that answered the check pulled the same rows, else what differs."""
    mine = {s: c for (t, r, d, s), c in res.cells.items() if (t, r, d) == (transport, rows, dim)}
    got = {s: c["check"] for s, c in mine.items() if c.get("check")}
    failed = [s for s, c in mine.items() if c.get("check_error")]
    tail = f" ({', '.join(failed)}: the check pull failed)" if failed else ""
    if len(got) < 2:
        return f"not compared{tail}" if failed else ""
    ref = next(iter(got.values()))["sha256"]
    if all(v["sha256"] == ref for v in got.values()):
        return f"agree{' among the others' if failed else ''}{tail}"
    return "differ: " + ", ".join(f"{s} sum {v['sum']:g}" for s, v in got.items()) + tail


def run_perftest(transport: str, dims: list[int], args: argparse.Namespace, res: Results) -> None:
    """``ucx_perftest ucp_get`` at each row size (32 gets in flight): the READ path's ceiling."""
    from rdmaflow.bench import perftest

    iters = 2000 if args.quick else 50_000
    for dim in dims:
        size = dim * 4
        vals = []
        note = ""
        for _ in range(1 if args.quick else 3):
            try:
                vals.append(perftest.run_perftest(transport, "get", size, iters=iters, timeout=120.0) / size)
            except (processes.BenchError, RuntimeError, FileNotFoundError) as e:
                note = processes.one_line(str(e), 300)
                break
        res.perftest[(transport, dim)] = {"gets_per_s": vals, "size": size, "note": note}


# -- report ----------------------------------------------------------------------------------------
def spread(vals: list[float]) -> dict:
    s = sorted(vals)
    return {"median": statistics.median(s), "p10": h.percentile(s, 0.1), "p90": h.percentile(s, 0.9),
            "iqr": h.percentile(s, 0.75) - h.percentile(s, 0.25), "min": s[0], "max": s[-1]}


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def csv_rows(res: Results, args: argparse.Namespace) -> list[dict]:
    out = []
    for (t, rows, dim, system), c in res.cells.items():
        for op in OPS:
            row = {"transport": t, "system": system, "rows": rows, "dim": dim, "keys": args.keys, "op": op,
                   "status": c["status"], "note": c["note"], "unique_keys": c.get("unique"),
                   "values": res.values.get((t, rows, dim), "") if c.get("check") else ""}
            if c["status"] == "ok" and c[op]:
                sp = spread(c[op])
                me = sp["median"]
                row.update({f"{k}_ms": v for k, v in sp.items()}, calls=len(c[op]),
                           vs_declared=_ratio(me, res.median(t, rows, dim, "declared", op)),
                           speedup_vs_tensorpipe=_ratio(res.median(t, rows, dim, "tensorpipe-dict", op), me),
                           speedup_vs_grpc=_ratio(res.median(t, rows, dim, "grpc-dict", op), me))
            out.append(row)
    for (t, dim), p in res.perftest.items():
        if p["gets_per_s"]:
            rate = statistics.median(p["gets_per_s"])
            ms = args.keys / rate * 1e3
            out.append({"transport": t, "system": "ucx_perftest ucp_get", "dim": dim, "keys": args.keys, "op": "get",
                        "status": "ok", "median_ms": ms, "min_ms": args.keys / max(p["gets_per_s"]) * 1e3,
                        "max_ms": args.keys / min(p["gets_per_s"]) * 1e3, "calls": len(p["gets_per_s"]),
                        "note": f"{rate:,.0f} gets/s of {p['size']} B, 32 in flight; ms: {args.keys} gets at that rate"})
        else:
            out.append({"transport": t, "system": "ucx_perftest ucp_get", "dim": dim, "op": "get", "status": "failed",
                        "note": p["note"]})
    return out


def table(res: Results, transport: str, rows_list: list[int], dims: list[int], systems: list[str],
          keys: int) -> str:
    lines = []
    for op in OPS:
        head = ["rows x dim", "unique"] + systems
        body = []
        for rows in rows_list:
            for dim in dims:
                cells = [res.cells.get((transport, rows, dim, s)) for s in systems]
                uniq = next((c.get("unique") for c in cells if c and c.get("unique")), None)
                row = [f"{rows:,} x {dim}", f"{uniq:.0f}" if uniq else "-"]
                for c in cells:
                    if c is None:
                        row.append("-")
                    elif c["status"] != "ok" or not c[op]:
                        row.append(c["status"])
                    else:
                        sp = spread(c[op])
                        row.append(f"{sp['median']:.3g} [{sp['p10']:.3g}-{sp['p90']:.3g}]")
                body.append(row)
        lines.append(f"{transport}, {op} of {keys:,} Zipf keys, ms: median [p10-p90] over every timed call")
        lines += h.text_table(head, body)
        ratio_head = ["rows x dim"]
        pairs = [(s, "declared") for s in systems if s in SPARSE and "declared" in systems]
        pairs += [(rpc, s) for s in systems if s in (*SPARSE, "declared") for rpc in RPC if rpc in systems]
        if pairs:
            ratio_head += [f"{SHORT[a]}/{SHORT[b]}" for a, b in pairs]
            rbody = []
            for rows in rows_list:
                for dim in dims:
                    r = [f"{rows:,} x {dim}"]
                    for a, b in pairs:
                        x = _ratio(res.median(transport, rows, dim, a, op), res.median(transport, rows, dim, b, op))
                        r.append("-" if x is None else f"{x:.3g}")
                    rbody.append(r)
            lines.append(f"{transport}, {op}: ratios of the medians, time over time ("
                         + ", ".join(f"{SHORT[x]}: {x}" for x in systems) + ")")
            lines += h.text_table(ratio_head, rbody)
        lines.append("")
    for (t, rows, dim, s), c in res.cells.items():
        if t == transport and c["status"] != "ok":
            lines.append(f"{s} at {rows:,} x {dim}: {c['status']}: {c['note']}")
    for (t, rows, dim, s), c in res.cells.items():
        if t == transport and c.get("check_error"):
            lines.append(f"{s} at {rows:,} x {dim}: its check pull ({2 * keys:,} keys) failed: {c['check_error']}")
    for (t, rows, dim), v in res.values.items():
        if t == transport and v:
            lines.append(f"values pulled at {rows:,} x {dim} after the same pushes: {v}")
    for (t, rows, dim, s), c in res.cells.items():
        if t == transport and c.get("stats"):
            st = dict(c["stats"])
            pulls = st.pop("pulls")
            lines.append(f"{s} at {rows:,} x {dim}, counters over its {pulls} pulls (warm-up included) and pushes: "
                         + ", ".join(f"{k} {v:,}" for k, v in sorted(st.items())))
    return "\n".join(lines)


def bars(res: Results, transports: list[str], dims: list[int]) -> list[dict]:
    """The targets at BAR_ROWS rows, pulls: each sparse system against the declared pull and the
    RPC servers, on each transport."""
    out = []
    for t in transports:
        most, speedup = BARS[t]
        for dim in dims:
            for s in SPARSE:
                me = res.median(t, BAR_ROWS, dim, s, "pull")
                c = res.cells.get((t, BAR_ROWS, dim, s))
                if c is None:
                    continue
                for peer in ("declared", *RPC):
                    theirs = res.median(t, BAR_ROWS, dim, peer, "pull")
                    if me is None:
                        why = f"{s} {c['status']}: {c['note']}"
                    elif theirs is None:
                        pc = res.cells.get((t, BAR_ROWS, dim, peer))
                        why = f"{peer} not measured" + (f": {pc['status']}: {pc['note']}" if pc else "")
                    else:
                        why = ""
                    if peer == "declared":
                        x = _ratio(me, theirs)
                        verdict = "n/a" if x is None else ("met" if x <= most else "missed")
                        target = f"<= {most:g}x"
                    else:
                        x = _ratio(theirs, me)
                        verdict, target = h.verdict(x, speedup), f">= {speedup:g}x faster"
                    out.append({"transport": t, "dim": dim, "system": s, "peer": peer, "ratio": x,
                                "target": target, "verdict": verdict, "why": why})
    return out


def format_bars(rows: list[dict]) -> str:
    lines = [f"targets, pull of present keys from {BAR_ROWS:,} rows:"]
    for b in rows:
        x = "-" if b["ratio"] is None else f"{b['ratio']:.3g}x"
        what = (f"{b['system']} / {b['peer']}" if b["peer"] == "declared" else f"{b['peer']} / {b['system']}")
        lines.append(f"  {b['transport']} x{b['dim']}: {what}  {x}  target: {b['target']}  {b['verdict']}"
                     + (f"  ({b['why']})" if b["why"] else ""))
    return "\n".join(lines)


def format_perftest(res: Results, args: argparse.Namespace) -> str:
    from rdmaflow.ps import sparse_table

    choices = getattr(sparse_table, "CHOICES", 2)  # the buckets a key may live in
    lines = []
    for (t, dim), p in res.perftest.items():
        if not p["gets_per_s"]:
            lines.append(f"{t} ucx_perftest ucp_get {p['size']} B: failed: {p['note']}")
            continue
        rate = statistics.median(p["gets_per_s"])
        line = (f"{t} ucx_perftest ucp_get {p['size']} B (a row of {dim}), 32 in flight: {rate:,.0f} gets/s "
                f"({1e6 / rate:.1f} us each)")
        for rows in sorted({r for (tt, r, d, s) in res.cells if tt == t and d == dim}):
            c = res.cells.get((t, rows, dim, "sparse-read"))
            me = res.median(t, rows, dim, "sparse-read", "pull")
            if me is None:
                continue
            st = c.get("stats") or {}
            entries = st.get("one_sided_rows", 0) / max(1, st.get("pulls", 0))
            # sparse.py's READ path: the keys of every bucket a key may live in, each entry found, the header
            reads = choices * args.keys + entries + 1
            line += (f"\n    sparse-read at {rows:,} rows: {me:.3g} ms a pull = {reads:,.0f} READs ({choices} bucket "
                     f"reads a key, "
                     f"{entries:,.0f} entries, the header) at {reads / me * 1e3:,.0f} READs/s; at perftest's rate they "
                     f"take {reads / rate * 1e3:.3g} ms")
        lines.append(line)
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from rdmaflow.bench import flags

    try:
        transports = flags.transports(args.transport)
        rows_list = _ints(args.rows or (QUICK_ROWS if args.quick else DEFAULT_ROWS), "--rows")
        dims = _ints(args.dims or (QUICK_DIMS if args.quick else DEFAULT_DIMS), "--dims")
        keys = _ints(args.keys or str(DEFAULT_KEYS), "--keys")
        systems = flags.choose(args.systems or SYSTEMS, SYSTEMS, "--systems")
        budget = h.parse_size(args.max_memory) if args.max_memory else int(0.6 * mem_available())
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if len(keys) != 1:
        print(f"error: --sparse takes one --keys value (keys per request), got {args.keys}", file=sys.stderr)
        return 2
    args.keys = keys[0]
    if args.quick:
        args.repeats, args.iters, args.warmup = 1, 3, 1
    args.repeats = args.repeats or 5
    args.iters = args.iters or 20
    args.warmup = 2 if args.warmup is None else args.warmup
    if args.repeats < 1 or args.iters < 1 or args.warmup < 0:
        print("error: --repeats and --iters must be >= 1, --warmup >= 0", file=sys.stderr)
        return 2
    systems = [s for s in SYSTEMS if s in systems]
    no_sparse = sparse_available() if any(s in SPARSE for s in systems) else ""
    if no_sparse:
        print(f"note: {no_sparse}: the SparseTable systems are reported n/a", flush=True)
    res = Results()
    print(f"rdmaflow bench kv --sparse: {args.keys:,} Zipf keys (s={args.zipf:g}) per request, rows "
          f"{', '.join(f'{r:,}' for r in rows_list)} x dim {', '.join(map(str, dims))}, {args.repeats} repeats of "
          f"{args.iters} pulls + {args.iters} pushes per system, memory budget {budget / 2**30:.1f} GiB", flush=True)

    def run_one(t: str) -> None:
        for rows in rows_list:
            for dim in dims:
                for batch in plan(systems, rows, dim, budget, res, t, no_sparse):
                    run_batch(batch, t, rows, dim, args, res)
                res.values[(t, rows, dim)] = compare_values(res, t, rows, dim)
        if t == "tcp" and "sparse-read" in systems and not args.no_perftest:
            run_perftest(t, dims, args, res)

    def save() -> None:
        os.makedirs(args.out, exist_ok=True)
        h.write_csv(os.path.join(args.out, "kv-sparse.csv"), CSV_COLUMNS, csv_rows(res, args))
        h.write_json(os.path.join(args.out, "kv-sparse.json"), {
            "command": " ".join(sys.argv), "keys": args.keys, "zipf": args.zipf, "seed": args.seed,
            "repeats": args.repeats, "iters": args.iters, "warmup": args.warmup, "budget_bytes": budget,
            "cells": [{"transport": t, "rows": r, "dim": d, "system": s, **{k: v for k, v in c.items()}}
                      for (t, r, d, s), c in res.cells.items()],
            "values": {f"{t} {r} {d}": v for (t, r, d), v in res.values.items()},
            "perftest": {f"{t} {d}": p for (t, d), p in res.perftest.items()},
            "bars": bars(res, transports, dims)})

    def show(t: str) -> str:
        text = table(res, t, rows_list, dims, systems, args.keys)
        pt = format_perftest(res, args) if t == "tcp" else ""
        return text + ("\n" + pt if pt else "")

    interrupted = h.for_each_transport(transports, run_one, show, save)
    if BAR_ROWS in rows_list and any(s in SPARSE for s in systems):
        print()
        print(format_bars(bars(res, transports, dims)))
    print(f"\nCSV: {os.path.join(args.out, 'kv-sparse.csv')}, JSON: {os.path.join(args.out, 'kv-sparse.json')}")
    failed = [c for c in res.cells.values() if c["status"] == "failed" or c.get("check_error")]
    differ = [v for v in res.values.values() if v.startswith("differ")]
    return 130 if interrupted else (1 if failed or differ else 0)

