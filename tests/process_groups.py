"""Ending a distributed worker with its process groups freed, not merely deregistered.

`dist.destroy_process_group()` deregisters the groups, but torch keeps each one alive through every
DeviceMesh made over it: DTensor specs and compile caches hold copies of the mesh (27 in a tp_sp
rank), each with its own name -> group registry. So the group was never destructed (its destructor
is what joins the gloo backend's threads: two `pt_gloo_runloop` workers and the `gloo_tcp_loop`
socket thread), and they ran on through interpreter shutdown and `exit()`. That is the likely
cause of a rank aborting once in a full suite run with SIGABRT, "terminate called without an
active exception" (not reproduced in 15 reruns; pytorch/pytorch#65513 and #190489 report that
abort for a gloo group not destroyed before exit).

`destroy_process_groups()` drops the meshes' registries once their groups are destroyed (a mesh
is unusable then), so the last reference goes now and each group's destructor joins its threads
before the interpreter shuts down.
"""

from __future__ import annotations

import gc
import weakref

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh


def destroy_process_groups() -> None:
    """`dist.destroy_process_group()`, then every group it destroyed freed (its threads joined).

    Raises RuntimeError naming the groups something still holds after that: their threads would
    run through the interpreter's shutdown."""
    # (a type test, not isinstance: DeviceMesh's metaclass check raises on dead weak proxies in the heap)
    meshes = [obj for obj in gc.get_objects() if type(obj) is DeviceMesh]
    groups = {dist.group.WORLD, *(group for mesh in meshes for group in _registry(mesh).values())}
    freed = [(weakref.ref(group), group.group_name) for group in groups]
    del groups
    dist.destroy_process_group()
    for mesh in meshes:
        _registry(mesh).clear()
    del meshes
    gc.collect()
    held = [name for ref, name in freed if ref() is not None]
    if held:
        raise RuntimeError(f"process group(s) {held} are still referenced after destroy_process_group(), so "
                           "their backend threads would run through interpreter shutdown; find the holder with "
                           "gc.get_referrers(group) and drop it before calling destroy_process_groups()")


def _registry(mesh: DeviceMesh) -> dict:
    """The mesh's name -> process group registry (torch 2.13's `DeviceMesh._pg_registry`)."""
    try:
        return mesh._pg_registry
    except AttributeError:
        raise RuntimeError("DeviceMesh has no `_pg_registry` in this torch version: update tests/process_groups.py "
                           "to drop the mesh's references to its process groups") from None
