"""How the ranks of an rdmaflow process group find each other: the process's one device, the job
secret, and the endpoints exchanged through the group's c10d store.

Keys, all under the store c10d hands the backend (already prefixed with the group's name, so
sub-groups and several groups never clash):

- ``rdmaflow/uid``: a random id the first rank to ask sets (``compare_set``): it names the
  group's pairs on the devices, so that a group made again under the same name in the same
  store never meets the pairs of the one before.
- ``rdmaflow/endpoint/<rank>``: each rank's device endpoint, set once its receivers exist.

The job secret is ``$RDMAFLOW_JOB_SECRET`` when set. Otherwise the first process to ask sets
one (``secrets.token_hex(16)``) under ``rdmaflow/c10d/secret`` in the store below every prefix
(the job's store), and every process uses the one stored there: a job under ``torchrun`` starts
without one, but such a secret protects nothing against whoever can reach the store
(docs/distributed.md, "Security").
"""
from __future__ import annotations

import atexit
import os
import secrets
import threading
from datetime import timedelta

import torch.distributed as dist

from rdmaflow import Device
from rdmaflow.job import route_address

SECRET_KEY = "rdmaflow/c10d/secret"

_device: Device | None = None
_device_lock = threading.Lock()


def root_store(store):
    """The store below every PrefixStore of ``store``."""
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return store


def job_secret(store) -> str:
    value = os.environ.get("RDMAFLOW_JOB_SECRET")
    if value is not None:
        return value  # the device refuses a weak one, saying how to make one (one rule for every layer)
    return root_store(store).compare_set(SECRET_KEY, "", secrets.token_hex(16)).decode()


def process_device(store, timeout: float) -> Device:
    """This process's device, made by its first rdmaflow group and shared by all the others."""
    global _device
    with _device_lock:
        if _device is None or getattr(_device, "closed", False):
            host = route_address(os.environ.get("MASTER_ADDR", "127.0.0.1"))
            _device = Device(f"{host}:0", secret=job_secret(store), connect_timeout=min(timeout, 30.0),
                             rpc_timeout=min(timeout, 60.0))
        return _device


@atexit.register
def _close_device() -> None:
    """Closes the process's device before the interpreter tears down what its threads use."""
    global _device
    device, _device = _device, None
    if device is not None:
        device.close()


def agree_uid(store) -> str:
    return store.compare_set("rdmaflow/uid", "", secrets.token_hex(8)).decode()


def exchange(store, rank: int, size: int, endpoint: str, timeout: float) -> list[str]:
    store.set_timeout(timedelta(seconds=timeout))
    store.set(f"rdmaflow/endpoint/{rank}", endpoint)
    return [store.get(f"rdmaflow/endpoint/{r}").decode() for r in range(size)]
