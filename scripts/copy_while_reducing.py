# copy 16/64 MiB into alternating slots in one thread while another reduces: the sm stream's two jobs
import threading
import time

import torch


def copy_loop(src, slots, k):
    t0 = time.perf_counter()
    for i in range(k): slots[i % 2].copy_(src)
    return (time.perf_counter() - t0) / k


def reduce_loop(other, k):
    t0 = time.perf_counter()
    for _ in range(k): float(other.max())
    return (time.perf_counter() - t0) / k


def reduce_until(stop, other):
    while not stop.is_set(): float(other.max())


torch.set_num_threads(1)
for mb in (16, 64):
    n = mb << 18
    src = torch.ones(n); slots = [torch.ones(n) for _ in range(2)]; other = torch.ones(n)
    k = 4096 // mb
    c = copy_loop(src, slots, k); r = reduce_loop(other, k)
    res = {}
    stop = threading.Event()
    th = threading.Thread(target=reduce_until, args=(stop, other)); th.start()
    res["copy|reduce"] = copy_loop(src, slots, k); stop.set(); th.join()
    print(f"{mb}M: copy alone {c*1e6:.0f} us, reduce alone {r*1e6:.0f} us, copy while the other core reduces {res['copy|reduce']*1e6:.0f} us")
