"""Connecting the Ray launcher to a cluster: `launch.ray.address`, or a local cluster started
for the run, listening on loopback unless `launch.allow_remote=true` (docs/ray.md)."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import signal
import threading

import ray
from ray._private import ray_constants

from asyncrl.config import RayLaunchConfig
from asyncrl.launch.fleet import LaunchError


def connect(rc: RayLaunchConfig, reserved: dict[str, float], loopback: bool) -> bool:
    """Connect to launch.ray.address, or start a local cluster with at least as many logical
    CPUs as the fleet reserves (listening on loopback only when `loopback`). Returns whether
    this call made the connection (and so must close it); an already connected process keeps
    its connection."""
    if ray.is_initialized():
        return False
    with _sigterm_kept():
        _init(rc, reserved, loopback)
    return True


@contextlib.contextmanager
def _sigterm_kept():
    """ray.init replaces the SIGTERM handling of the process: a Python handler that exits,
    then a C++ crash handler that aborts without cleanup. Put a Python-level handler back:
    the caller's (the CLI's turns SIGTERM into KeyboardInterrupt, so the fleet is stopped as
    on Ctrl-C), else Ray's exit, which still runs the launcher's `finally`."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGTERM)
    try:
        yield
    finally:
        if not (callable(previous) or previous == signal.SIG_IGN):
            previous = signal.getsignal(signal.SIGTERM)  # Ray's exit
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def _loopback_node(loopback: bool):
    """While a local cluster starts: give its node the address 127.0.0.1. Ray binds its GCS,
    raylet (node and object manager), runtime-env agent and every worker's gRPC server to
    loopback only when the node's address is 127.0.0.1, and picks that address only where it
    thinks it cannot cluster: RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, read when Ray is imported
    (the processes the cluster starts get it from the environment; this one, which imported
    Ray already, gets the constant set). Both are restored afterwards."""
    if not loopback:
        yield
        return
    var = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
    saved_env, saved = os.environ.get(var), ray_constants.ENABLE_RAY_CLUSTER
    os.environ[var], ray_constants.ENABLE_RAY_CLUSTER = "0", False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved
        if saved_env is None:
            os.environ.pop(var, None)
        else:
            os.environ[var] = saved_env
    if (ip := ray.util.get_node_ip_address()) != "127.0.0.1":  # a Ray that decides otherwise
        ray.shutdown()
        raise LaunchError(
            f"the local Ray cluster took the address {ip}, not loopback: its servers would "
            "listen beyond this machine (launch.allow_remote=true allows that)"
        )


def _init(rc: RayLaunchConfig, reserved: dict[str, float], loopback: bool) -> None:
    quiet = logging.WARNING  # the actors' output is in run_dir/logs, not on the driver
    if rc.address is not None:
        try:
            ray.init(
                address=rc.address,
                namespace=rc.namespace,
                log_to_driver=False,
                logging_level=quiet,
            )
        except (ConnectionError, RuntimeError, ValueError) as e:
            raise LaunchError(f"cannot connect to the Ray cluster at {rc.address!r}: {e}") from e
        print(f"asyncrl: connected to the Ray cluster at {rc.address}", flush=True)
        return
    num_cpus = max(os.cpu_count() or 1, math.ceil(reserved["CPU"]))
    with _loopback_node(loopback):
        ray.init(
            address="local",  # a new cluster even if one runs here already
            num_cpus=num_cpus,
            include_dashboard=False,
            object_store_memory=128 << 20,  # nothing large goes through Ray
            namespace=rc.namespace,
            log_to_driver=False,
            logging_level=quiet,
        )
    gpus = ray.cluster_resources().get("GPU", 0)
    print(f"asyncrl: started a local Ray cluster ({num_cpus} CPUs, {gpus:g} GPUs)", flush=True)
    if reserved["GPU"] > gpus:
        ray.shutdown()
        raise LaunchError(f"the fleet reserves {reserved['GPU']:g} GPUs; this machine has {gpus:g}")
