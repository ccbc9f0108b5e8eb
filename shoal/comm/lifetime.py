"""Process groups let go of before the interpreter shuts down.

torch destroys a backend's process group (gloo, NCCL) when the last
reference to it goes. If that happens while the interpreter finalizes,
the backend's threads can no longer take the GIL and the process aborts
with ``terminate called without an active exception`` (exit code 134),
after the script has finished and even after it called
``torch.distributed.destroy_process_group()``: that call takes the group
out of torch's registry, but a shoal group (or a wrapper in a reference
cycle that the garbage collector has not reached yet) still holds it.
The launcher then sees a failed worker.

So every shoal object that holds a process group registers here, and an
``atexit`` handler (it runs after the script and its non-daemon threads,
while the interpreter is whole) collects reference cycles, has each holder
drop its process groups, and collects again: the groups are destroyed
then, not during finalization. A holder is not used after that; nothing of
the script runs after its ``atexit`` handlers.
"""

from __future__ import annotations

import atexit
import gc
import weakref
from typing import Protocol


class Holder(Protocol):
    """An object that holds process groups and can let go of them at exit."""

    def _let_go_at_exit(self) -> None: ...


_HOLDERS: weakref.WeakSet[Holder] = weakref.WeakSet()


def hold(holder: Holder) -> None:
    """Have ``holder`` drop its process groups when the interpreter exits (a weak reference: no leak)."""
    _HOLDERS.add(holder)


def release_all() -> None:
    """Drop every registered holder's process groups and collect cycles (the ``atexit`` handler)."""
    gc.collect()   # wrappers in reference cycles go now, while their groups can still be destroyed
    for holder in list(_HOLDERS):
        holder._let_go_at_exit()
    _HOLDERS.clear()
    gc.collect()


atexit.register(release_all)
