"""Which services a parameter-server job runs, and a shard process that serves all of them.

A job's workers may use several services of ``rdmaflow.ps`` at once: a ``DistributedOptimizer``
("optimizer": the dense part of a model) beside ``SparseTable``s ("sparse": its embeddings) or a
``KVStore`` ("kv"), say. Each service has its own shard side (``Shard``, ``SparseShard``,
``KVShard``: an object with ``run()``), with its own registered memory, flags and done words;
they share the shard process's device and the job's store, under keys of their own.

Who writes what, in what order (the job's c10d store, key ``services``)::

    worker 0: ps.init(services=[...])       writes the sorted list once, at init; or, without
              (or its first service made)   services=, when it makes its first service: that
                                            one alone
    shards:   ps.init()                     wait for the list (bounded, ps.init's timeout), then
                                            run every service on it: the first on this thread,
                                            each other one in a thread of its own
    worker w: its first service made        compares its own list (services=, else that first
                                            service alone) with worker 0's: a difference aborts
                                            the job, naming both lists

Shards learn the list before any service starts and never from a later call, so no service can
be missed: a worker that makes a service its list does not name raises at once. A shard process
exits when every one of its services is done. A service that fails leaves its reason in the
process (``stop_others``) before it tells anyone else, then aborts the job (the store's abort key)
and tells its own workers; the process's other services look at it once per step or request
(``stopping``) and stop too, telling theirs.
"""
from __future__ import annotations

import json
import threading
import time

from rdmaflow import InvalidArgumentError
from rdmaflow.ps.context import dumps

KEY = "services"
# name -> the worker's class; "sparse" stands for all of a job's SparseTables (one shard service)
SERVICES = {"optimizer": "DistributedOptimizer", "kv": "KVStore", "sparse": "SparseTable"}
STOP_SECONDS = 30.0  # how long a shard waits, after a failure or Ctrl-C, for its other services to stop


def checked(services) -> tuple[str, ...] | None:
    """``ps.init(services=...)``: None, or a non-empty collection of known names (sorted, once each)."""
    if services is None:
        return None
    if isinstance(services, str):
        services = (services,)
    try:
        names = list(services)
    except TypeError:
        raise InvalidArgumentError(f"services must be a list of names from {sorted(SERVICES)}, "
                                   f"got {type(services).__name__}") from None
    bad = [n for n in names if n not in SERVICES]
    if bad or not names:
        raise InvalidArgumentError(f"services must name at least one of {sorted(SERVICES)}, got {names!r}")
    if len(set(names)) != len(names):
        raise InvalidArgumentError(f"services names a service twice: {names!r}")
    return tuple(sorted(names))


def _names(services) -> str:
    return " and ".join(SERVICES[n] for n in services)


def announce(ctx) -> None:
    """At ``ps.init`` on worker 0: writes the job's services, if it was given them."""
    if ctx.services is not None and ctx.role.index == 0:
        ctx.store.set(KEY, dumps(list(ctx.services)))
        ctx.services_agreed = True


def declare(ctx, kind: str) -> None:
    """A worker makes service ``kind``: checks it against this worker's list and, the first time,
    this worker's list against worker 0's (which worker 0 writes now if ``init`` did not)."""
    mine = ctx.services if ctx.services is not None else (kind,)
    if kind not in mine:
        raise InvalidArgumentError(
            f"this worker's job runs {_names(mine)} only, and its shards serve nothing else: to use a "
            f"{SERVICES[kind]} beside it, give every worker ps.init(services={sorted(set(mine) | {kind})!r})")
    if getattr(ctx, "services_agreed", False):
        return
    store = ctx.store
    if ctx.role.index == 0:
        store.set(KEY, dumps(list(mine)))
    job = tuple(json.loads(store.get(KEY)))
    if job != mine:
        raise InvalidArgumentError(f"worker {ctx.role.index} uses {_names(mine)}, but worker 0 declared "
                              f"{_names(job)}: every worker of a job must declare the same services "
                              "(ps.init(services=...))")
    ctx.services = mine
    ctx.services_agreed = True


def stop_others(ctx, reason: str) -> None:
    """A service of this shard process failed: the others stop at their next look (``stopping``),
    before its workers learn of it, so that none of theirs gets another reply meanwhile."""
    if getattr(ctx, "stop_reason", None) is None:
        ctx.stop_reason = reason


def stopping(ctx) -> str | None:
    """Why another service of this shard process failed, if one did (an attribute read: a service
    looks at it once per request or step, as its loop goes round)."""
    return getattr(ctx, "stop_reason", None)


def job_services(ctx) -> tuple[str, ...]:
    """On a shard: the services worker 0 declared (a failure to read them aborts the job)."""
    try:
        names = tuple(json.loads(ctx.store.get(KEY)))
        if not names or any(n not in SERVICES for n in names):
            raise InvalidArgumentError(f"worker 0 declared services {list(names)}; this shard knows "
                                       f"{sorted(SERVICES)}: are all processes running the same rdmaflow?")
    except Exception as e:
        ctx.store.abort(f"shard {ctx.role.index}: {e}")
        raise
    return names


def serve(ctx, makers: dict) -> dict:
    """Runs every service of the job (``makers``: name -> a callable that makes its shard side)
    until each is done; returns its statistics (one service: its own; several: by name). The
    first service runs on this thread, so Ctrl-C reaches it as in a job of one service; each
    other one in a thread of its own. A failure in any is raised here once all have stopped
    (the others stop on the job's abort, which the failing one recorded)."""
    names = job_services(ctx)
    services = [makers[n]() for n in names]
    if len(services) == 1:
        return services[0].run()
    # A worker makes its services one after the other, each after the last one's setup, and may
    # compute between them: a service's shard side waits for its declaration as for a step.
    ctx.declare_timeout = max(ctx.timeout, ctx.step_timeout)
    stats: dict = {}
    errors: dict[str, BaseException] = {}

    def run(name, service):
        try:
            stats[name] = service.run()
        except BaseException as e:  # noqa: BLE001 - reported by the thread that joins
            errors[name] = e

    threads = [threading.Thread(target=run, args=(n, s), name=f"rdmaflow-ps-{n}", daemon=True)
               for n, s in zip(names[1:], services[1:])]
    for t in threads:
        t.start()
    first: BaseException | None = None
    try:
        stats[names[0]] = services[0].run()
    except BaseException as e:  # noqa: BLE001 - raised below, once the others have stopped
        first = e
    stop_by = None  # once something failed: how long the others may take to see the abort
    for t in threads:
        while t.is_alive():
            if stop_by is None and (first is not None or errors):
                stop_by = time.monotonic() + STOP_SECONDS
            if stop_by is not None and time.monotonic() >= stop_by:
                break  # a daemon thread: the process exits without it
            try:
                t.join(0.5 if stop_by is None else max(0.0, min(0.5, stop_by - time.monotonic())))
            except KeyboardInterrupt as e:  # Ctrl-C while a service thread still serves
                ctx.store.abort(f"shard {ctx.role.index}: interrupted (SIGINT)")
                first = first or e
    if first is not None:
        raise first
    if errors:
        raise next(iter(errors.values()))
    return {"services": stats}
