"""One trace per process: `forked(fn, *args)` runs fn in a forked child and hands back its value or its error
(a rank's fake process group, meshes and the groups DTensor caches by name belong to that child alone);
`warm_imports` loads, once before forking, what the first fake-tensor op would otherwise import in every child.
"""

from __future__ import annotations

from typing import Any

from stratagem.errors import StratagemError

__all__ = ["TraceFailed", "forked", "warm_imports"]


class TraceFailed(StratagemError):
    """The harness's own step raised while a plan was traced (what a real run of the plan would likely meet
    too): one line; the child process's traceback is kept in `details`."""

    def __init__(self, message: str, details: str) -> None:
        super().__init__(message)
        self.details = details


def warm_imports() -> None:
    """Import what the first fake-tensor op would import (torch._dynamo: seconds) once, before forking."""
    import torch._dynamo  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401
    import torch.distributed.pipelining  # noqa: F401
    import torch.distributed.tensor.parallel  # noqa: F401
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        torch.empty(2, device="meta").normal_()


def forked(fn: Any, *args: Any) -> Any:
    """fn(*args) in a forked child; its return value or its exception comes back through a pipe."""
    import multiprocessing
    import os
    import traceback

    ctx = multiprocessing.get_context("fork")
    receiver, sender = ctx.Pipe(duplex=False)
    pid = os.fork()
    if pid == 0:  # child
        code = 0
        try:
            receiver.close()
            try:
                sender.send(("ok", fn(*args)))
            except StratagemError as e:
                sender.send(("error", e))
            except BaseException as e:  # sent to the parent, which raises it with the child's traceback
                sender.send(("crash", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
            sender.close()
        finally:
            os._exit(code)
    sender.close()
    try:
        kind, value = receiver.recv()
    except EOFError:
        kind, value = "crash", "the tracing process died without a result"
    finally:
        receiver.close()
        os.waitpid(pid, 0)
    if kind == "ok":
        return value
    if kind == "error":
        raise value
    first = value.splitlines()[0] if value else "no result"
    raise TraceFailed(f"the harness's step failed under tracing ({first[:400]})", value)
