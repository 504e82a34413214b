"""A device lost to kvd's process: kvd exits, for its service manager to start it again.

Some CUDA errors (an illegal memory access, a device-side assert, a launch failure, an
uncorrectable ECC error) leave the process's CUDA context unusable: every later call on the
device fails, and only a new process can use the GPU again. A kvd that served on would answer
every request 500 `engine_error` until someone restarted it by hand, and its /readyz would say
ready again every 10 s (step_failures.py) to fail the next requests sent.

So when a failed step's error is the device's (torch.AcceleratorError; an out of memory is not
one), kvd asks the device a trivial question (`answer_of`); when that fails too, the device is
lost to this process: kvd answers the requests in flight 500 as for any failed step, refuses new
ones 503 (its /healthz and /readyz too), records the loss in its audit log (`kvctl audit --action
exit`), saves what its host tier holds to the disk tier (the device's blocks cannot be read), and
exits with DEVICE_LOST_EXIT, so that systemd (Restart=on-failure) or a container's restart policy
starts it on a fresh context. vLLM's server does the like when its engine dies.

A device can be lost while kvd is idle too (a GPU fallen off the bus, an uncorrectable ECC error):
kvd said it was well until a request came, which got a 500. So the idle engine thread asks the
device the same question every IDLE_CHECK_SECONDS (`idle_check`); when it is not answered, the
device is lost as above, and kvd exits before a request meets it.
"""

from __future__ import annotations

import torch

DEVICE_LOST_EXIT = 75  # EX_TEMPFAIL: started again, it may well serve
IDLE_CHECK_SECONDS = 30.0  # the idle engine asks its device this often (a question of some 50 us on a GPU)


def lost_device(exc: BaseException, device: torch.device) -> str | None:
    """Why the device is lost to this process after a step failed with `exc` (its error and what
    the device answered a trivial question with); None when it is not."""
    if not isinstance(exc, torch.AcceleratorError):
        return None
    try:
        answer_of(device)
    except Exception as again:
        return f"{type(exc).__name__}: {exc}"[:300] + f"; then {type(again).__name__}: {again}"[:200]
    return None


def idle_check(device: torch.device) -> str | None:
    """Why the device is lost to this process, asked while kvd is idle; None when it answers."""
    try:
        answer_of(device)
    except Exception as exc:
        return f"it did not answer kvd's idle check: {type(exc).__name__}: {exc}"[:500]
    return None


def answer_of(device: torch.device) -> None:
    """A trivial question to the device, its answer waited for: raises when the device cannot
    be used (a CUDA context an earlier error left unusable)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    (torch.ones(1, device=device) + 1).cpu()


def refusal(why: str | None = None) -> str:
    """What a request is refused with (503) once the device is lost; /healthz and /readyz add `why`
    (a client is not told the error: it is the operator's)."""
    return ("kvd's device failed and cannot be used again by this process" + (f" ({why})" if why else "")
            + ": kvd is exiting, to be started again")
