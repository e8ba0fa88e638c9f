# copy 16/64 MiB into alternating slots in one thread while another reduces: the sm stream's two jobs
import threading
import time

import torch

torch.set_num_threads(1)
for mb in (16, 64):
    n = mb << 18
    src = torch.ones(n); slots = [torch.ones(n) for _ in range(2)]; other = torch.ones(n)
    def copy_loop(k):
        t0 = time.perf_counter()
        for i in range(k): slots[i % 2].copy_(src)
        return (time.perf_counter() - t0) / k
    def reduce_loop(k):
        t0 = time.perf_counter()
        for i in range(k): float(other.max())
        return (time.perf_counter() - t0) / k
    k = 4096 // mb
    c = copy_loop(k); r = reduce_loop(k)
    res = {}
    stop = threading.Event()
    def bg():
        while not stop.is_set(): float(other.max())
    th = threading.Thread(target=bg); th.start(); res["copy|reduce"] = copy_loop(k); stop.set(); th.join()
    print(f"{mb}M: copy alone {c*1e6:.0f} us, reduce alone {r*1e6:.0f} us, copy while the other core reduces {res['copy|reduce']*1e6:.0f} us")
