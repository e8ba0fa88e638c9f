"""One rank of a torch.distributed job that runs the "rdmaflow" backend beside gloo.

Ranks get torchrun's variables (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT); DIST_TEST_CONFIG
(JSON) names the scenario:

- ``ops``: every op on the rdmaflow default group and on a gloo group of the same ranks, with
  the same inputs; results must be equal (floats: within summation-order tolerance). Also
  dtypes, 0-element and 0-dim tensors, shapes that change, tags out of order, recv from any
  source, a sub-group, the wrong-size error and an unsupported op's error.
- ``ddp``: a small model trained with DistributedDataParallel over each group; parameters equal.
- ``pipe``: torch.distributed.pipelining GPipe over each group; parameters equal.
- ``dead``: the last rank exits mid-job; rank 0's recv from it must raise naming it.
- ``smoke``: an all_reduce, a broadcast_object_list and a barrier (under torchrun, without a
  job secret).

Prints ``OK <scenario>`` at the end; any failure raises (non-zero exit).
"""
from __future__ import annotations

import json
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import rdmaflow
import rdmaflow.distributed as rd

CFG = json.loads(os.environ.get("DIST_TEST_CONFIG", "{}"))
RANK, WORLD = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8, torch.int16,
          torch.int32, torch.int64, torch.bool, torch.complex64, torch.complex128, torch.uint16, torch.uint32]


def same(name: str, a: torch.Tensor, b: torch.Tensor) -> None:
    if a.dtype != b.dtype or a.shape != b.shape:
        raise AssertionError(f"{name}: {a.dtype}{list(a.shape)} vs gloo's {b.dtype}{list(b.shape)}")
    if a.dtype.is_floating_point or a.dtype.is_complex:
        ok = torch.allclose(a, b, rtol=1e-5, atol=1e-5)
    else:  # as bytes: torch.equal has no kernel for every integer dtype (uint16, uint32)
        ok = torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)) if a.numel() else True
    if not ok:
        raise AssertionError(f"{name} on rank {RANK}: rdmaflow {a.flatten()[:8].tolist()} vs gloo "
                             f"{b.flatten()[:8].tolist()}")


def data(shape, dtype=torch.float32, salt: int = 0, rank: int = RANK) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + salt)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    return torch.randint(1, 5, shape, generator=g).to(dtype)


def compare(name: str, fn, groups) -> None:
    """``fn(group)`` returns tensors; those of the rdmaflow group must equal gloo's."""
    rd_out, gloo_out = fn(groups[0]), fn(groups[1])
    for i, (a, b) in enumerate(zip(rd_out, gloo_out, strict=True)):
        same(f"{name}[{i}]", a, b)


def collectives(groups, n: int, grank: int) -> None:
    O = dist.ReduceOp
    for numel in (0, 1, 7, 1000, 70_000):  # direct up to 64 KiB per rank, ring above; shapes change
        for dtype, ops in ((torch.float32, (O.SUM, O.PRODUCT, O.MIN, O.MAX)),
                           (torch.int64, (O.SUM, O.MIN, O.MAX)),
                           (torch.int32, (O.BAND, O.BOR, O.BXOR))):
            for op in ops:
                def ar(g, op=op, dtype=dtype, numel=numel):
                    t = data((numel,), dtype, 1, grank)
                    dist.all_reduce(t, op=op, group=g)
                    return [t]
                compare(f"all_reduce {op} {dtype} {numel}", ar, groups)
        t = data((numel,), torch.float32, 2, grank)
        dist.all_reduce(t, op=O.AVG, group=groups[0])
        s = data((numel,), torch.float32, 2, grank)
        dist.all_reduce(s, group=groups[1])
        same(f"all_reduce AVG {numel}", t, s / n)
        for root in range(n):
            def bc(g, root=root, numel=numel):
                t = data((numel, 2), torch.float64, 3, grank)
                dist.broadcast(t, group_src=root, group=g)
                return [t]
            compare(f"broadcast root {root} {numel}", bc, groups)

            def red(g, root=root, numel=numel):
                t = data((numel,), torch.float32, 4, grank)
                dist.reduce(t, group_dst=root, group=g)
                return [t] if grank == root else []
            compare(f"reduce root {root} {numel}", red, groups)

        def ag(g, numel=numel):
            out = [torch.empty(numel, dtype=torch.int8) for _ in range(n)]
            dist.all_gather(out, data((numel,), torch.int8, 5, grank), group=g)
            return out
        compare(f"all_gather {numel}", ag, groups)

        def agt(g, numel=numel):
            out = torch.empty(n * numel, 3)
            dist.all_gather_into_tensor(out, data((numel, 3), torch.float32, 6, grank), group=g)
            return [out]
        compare(f"all_gather_into_tensor {numel}", agt, groups)

        def rs(g, numel=numel):
            out = torch.empty(numel)
            dist.reduce_scatter(out, [data((numel,), torch.float32, 7 + j, grank) for j in range(n)], group=g)
            return [out]
        compare(f"reduce_scatter {numel}", rs, groups)

        def rst(g, numel=numel):
            out = torch.empty(numel, dtype=torch.int64)
            dist.reduce_scatter_tensor(out, data((n * numel,), torch.int64, 8, grank), group=g)
            return [out]
        compare(f"reduce_scatter_tensor {numel}", rst, groups)

        def a2a(g, numel=numel):
            out = [torch.empty(numel) for _ in range(n)]
            dist.all_to_all(out, [data((numel,), torch.float32, 9 + j, grank) for j in range(n)], group=g)
            return out
        compare(f"all_to_all {numel}", a2a, groups)

    for root in range(n):
        def ga(g, root=root):
            out = [torch.empty(5) for _ in range(n)] if grank == root else None
            dist.gather(data((5,), salt=10), out, group_dst=root, group=g)
            return out or []
        compare(f"gather root {root}", ga, groups)

        def sc(g, root=root):
            out = torch.empty(4, dtype=torch.int32)
            ins = [data((4,), torch.int32, 11 + j) for j in range(n)] if grank == root else None
            dist.scatter(out, ins, group_src=root, group=g)
            return [out]
        compare(f"scatter root {root}", sc, groups)

    def a2as(g):  # uneven splits: rank r sends j + 1 rows to rank j
        ins = data((sum(j + 1 for j in range(n)), 2), salt=12)
        out = torch.empty((grank + 1) * n, 2)
        dist.all_to_all_single(out, ins, [grank + 1] * n, [j + 1 for j in range(n)], group=g)
        return [out]
    compare("all_to_all_single uneven", a2as, groups)

    def a2ae(g):
        out = torch.empty(4 * n)
        dist.all_to_all_single(out, data((4 * n,), salt=13), group=g)
        return [out]
    compare("all_to_all_single even", a2ae, groups)

    def objs(g):
        got = [None] * n
        dist.all_gather_object(got, {"rank": grank, "payload": list(range(grank + 3))}, group=g)
        lst = [{"x": grank}, "y"] if grank == 0 else [None, None]
        dist.broadcast_object_list(lst, group_src=0, group=g)
        return [torch.tensor([len(json.dumps(got)), len(json.dumps(lst))])]
    compare("object collectives", objs, groups)
    dist.barrier(group=groups[0])


def point_to_point() -> None:
    n, nxt, prv = WORLD, (RANK + 1) % WORLD, (RANK - 1) % WORLD
    # every dtype, 0-element and 0-dim tensors, shapes that change between calls: a ring
    for i, dtype in enumerate(DTYPES):
        for shape in ((3, 5), (0,), (), (1000,), (2, 0, 4), (70_000,)):
            send = data(shape, dtype, 20 + i)
            got = torch.empty(shape, dtype=dtype)
            ops = [dist.P2POp(dist.isend, send, nxt), dist.P2POp(dist.irecv, got, prv)]
            for w in dist.batch_isend_irecv(ops):
                w.wait()
            same(f"ring {dtype} {list(shape)}", got, data(shape, dtype, 20 + i, rank=prv))
    if RANK == 0:
        # tags: sent 1, 2, 1; received 2 first, then both 1s in their order
        for tag, v in ((1, 10.0), (2, 20.0), (1, 11.0)):
            dist.send(torch.full((3,), v), 1, tag=tag)
        w = dist.isend(torch.arange(6.0), 1)
        w.wait()
        assert w.is_completed() and w.exception() is None
    elif RANK == 1:
        a, b, c = torch.empty(3), torch.empty(3), torch.empty(3)
        wb, wc = dist.irecv(b, 0, tag=1), dist.irecv(c, 0, tag=1)
        dist.recv(a, 0, tag=2)
        wc.wait()  # completes b's receive first: per (peer, tag) in the order posted
        assert wb.is_completed()
        assert a[0] == 20 and b[0] == 10 and c[0] == 11, (a, b, c)
        fut_t = torch.empty(6)
        w = dist.irecv(fut_t, 0)
        w.wait()
        assert w.get_future().done() and torch.equal(fut_t, torch.arange(6.0))
    # ranks 0 and 1 each send more messages than a pair's credits before receiving any: small
    # (frame pair) and large (bulk pair) ones; the waiting sender takes in what the other sent
    if RANK in (0, 1):
        other = 1 - RANK
        for i in range(rd.mailbox.DEPTH + 8):
            dist.send(torch.full((3 if i % 2 else 5000,), float(i)), other, tag=3)
        for i in range(rd.mailbox.DEPTH + 8):
            t = torch.empty(3 if i % 2 else 5000)
            dist.recv(t, other, tag=3)
            assert torch.equal(t, torch.full_like(t, float(i))), (i, t[:3])
    # recv from any source: rank 0 hears from every other rank
    if RANK == 0:
        seen = set()
        for _ in range(n - 1):
            t = torch.empty(1, dtype=torch.int64)
            src = dist.recv(t, tag=7)
            assert t.item() == src, (t, src)
            seen.add(src)
        assert seen == set(range(1, n)), seen
    else:
        dist.send(torch.tensor([RANK]), 0, tag=7)
    # a recv into a tensor of the wrong size raises, naming both sizes
    if RANK == 0:
        dist.send(torch.ones(4), 1, tag=9)
    elif RANK == 1:
        try:
            dist.recv(torch.empty(3), 0, tag=9)
        except rdmaflow.InvalidArgumentError as e:
            assert "16 bytes" in str(e) and "sizes must match" in str(e), e
        else:
            raise AssertionError("a recv into a tensor of the wrong size did not raise")
    dist.barrier()


def scenario_ops() -> None:
    gloo = dist.new_group(backend="gloo")
    collectives([dist.group.WORLD, gloo], WORLD, RANK)
    point_to_point()
    # a sub-group of ranks 0 and 1, side by side with gloo's
    sub_rd = dist.new_group([0, 1], backend="rdmaflow")
    sub_gloo = dist.new_group([0, 1], backend="gloo")
    if RANK in (0, 1):
        for numel in (5, 70_000):
            def ar(g, numel=numel):
                t = data((numel,), salt=30)
                dist.all_reduce(t, group=g)
                return [t]
            compare(f"sub-group all_reduce {numel}", ar, [sub_rd, sub_gloo])
    pg = dist.distributed_c10d._get_default_group()
    try:
        pg.reduce_scatter_tensor_coalesced([torch.empty(1)], [torch.empty(WORLD)], dist.ReduceScatterOptions())
    except rd.UnsupportedOpError as e:
        assert "reduce_scatter_tensor_coalesced" in str(e), e
    else:
        raise AssertionError("an unsupported op did not raise")
    try:
        dist.all_reduce(torch.ones(2), op=dist.ReduceOp.BAND)
    except rdmaflow.InvalidArgumentError as e:
        assert "BAND" in str(e), e
    else:
        raise AssertionError("BAND on floats did not raise")
    dist.barrier(group=gloo)


def model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16), torch.nn.ReLU(),
                               torch.nn.Linear(16, 4))


def scenario_ddp() -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    gloo = dist.new_group(backend="gloo")
    trained = []
    for g in (dist.group.WORLD, gloo):
        m = DDP(model(5), process_group=g, bucket_cap_mb=0.001)  # several buckets
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        for step in range(4):
            x, y = data((6, 8), salt=40 + step), data((6, 4), salt=50 + step)
            opt.zero_grad()
            torch.nn.functional.mse_loss(m(x), y).backward()
            opt.step()
        trained.append([p.detach().clone() for p in m.parameters()])
    for i, (a, b) in enumerate(zip(*trained, strict=True)):
        same(f"DDP parameter {i}", a, b)
    dist.barrier(group=gloo)


def scenario_pipe() -> None:
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    gloo = dist.new_group(backend="gloo")
    per = -(-len(model(6)) // WORLD)
    trained = []
    for g in (dist.group.WORLD, gloo):
        part = torch.nn.Sequential(*list(model(6))[RANK * per:(RANK + 1) * per])  # the same start for both
        stage = PipelineStage(part, RANK, WORLD, torch.device("cpu"), group=g)
        sched = ScheduleGPipe(stage, n_microbatches=4, loss_fn=torch.nn.functional.mse_loss)
        opt = torch.optim.SGD(part.parameters(), lr=0.1)
        for step in range(3):
            x, y = data((8, 8), salt=60 + step, rank=0), data((8, 4), salt=70 + step, rank=0)
            opt.zero_grad()
            if RANK == 0:
                sched.step(x)
            elif RANK == WORLD - 1:
                sched.step(target=y)
            else:
                sched.step()
            opt.step()
        trained.append([p.detach().clone() for p in part.parameters()])
    for i, (a, b) in enumerate(zip(*trained, strict=True)):
        same(f"pipeline parameter {i}", a, b)
    dist.barrier(group=gloo)


def scenario_dead() -> None:
    victim = WORLD - 1
    dist.barrier()
    # rank 0 has passed the barrier (READ the victim's message) once the victim has its "go":
    # only then does the victim leave, so that the barrier itself never waits on a dead rank
    if RANK == 0:
        dist.send(torch.ones(1), victim)
    if RANK == victim:
        dist.recv(torch.empty(1), 0)
        os._exit(3)
    t0 = time.monotonic()
    try:
        dist.recv(torch.empty(2), victim)
    except rdmaflow.RdmaflowError as e:
        took = time.monotonic() - t0
        assert f"rank {victim}" in str(e), e
        print(f"DEAD_PEER_ERROR after {took:.1f} s: {type(e).__name__}: {e}", flush=True)
    else:
        raise AssertionError("a recv from a dead rank returned")
    os._exit(0)  # the store's server may be gone with the victim: leave without the teardown


def scenario_smoke() -> None:
    t = torch.full((4,), float(RANK + 1))
    dist.all_reduce(t)
    assert torch.equal(t, torch.full((4,), float(WORLD * (WORLD + 1) // 2))), t
    objs = [{"from": RANK}]
    dist.broadcast_object_list(objs, group_src=0)
    assert objs == [{"from": 0}], objs
    dist.barrier()


def main() -> None:
    scenario = CFG.get("scenario", "ops")
    dist.init_process_group("rdmaflow", timeout=timedelta(seconds=CFG.get("timeout", 60)))
    assert dist.get_backend() == "rdmaflow", dist.get_backend()
    {"ops": scenario_ops, "ddp": scenario_ddp, "pipe": scenario_pipe, "dead": scenario_dead,
     "smoke": scenario_smoke}[scenario]()
    dist.destroy_process_group()
    print(f"OK {scenario}", flush=True)


if __name__ == "__main__":
    main()
