"""The engine's environment switches and the values each takes.

``RINGATTN_KERNEL`` forces the block kernel (``kernels.select_kernel``; unset: chosen per call
by device and dtype), ``RINGATTN_TRANSPORT`` the ring's transport (``shm.ring_transport``).
No torch here: ringctl checks a job's values when it reads the config, before any rank starts
(a misspelled kernel passed submit and failed every rank with a traceback, after the queue
wait), by the rule the engine reads them with.
"""

from __future__ import annotations

KERNEL = "RINGATTN_KERNEL"
TRANSPORT = "RINGATTN_TRANSPORT"
# The kernels RINGATTN_KERNEL may force and the devices each computes on: the engine refuses
# one on another device (``kernels.select_kernel``; torch-cuda on a CPU job failed every rank
# with a traceback from the efficient-attention op), and ringctl where a job's config decides
# its ranks' device.
KERNEL_DEVICES = {
    "chunked": ("cpu", "cuda"),
    "flash": ("cuda",),
    "torch": ("cpu",),
    "torch-cpu": ("cpu",),
    "torch-cuda": ("cuda",),
}
CHOICES = {
    KERNEL: tuple(KERNEL_DEVICES),
    TRANSPORT: ("auto", "gloo", "shm"),
}
DEFAULTS = {KERNEL: "", TRANSPORT: "auto"}  # "": no kernel forced


def choice(name: str, value: str | None) -> str:
    """The switch ``name``'s value as the engine takes it (case and blanks aside; unset or
    blank: its default); ValueError naming the variable and its choices for anything else."""
    text = (value or "").strip().lower() or DEFAULTS[name]
    if text and text not in CHOICES[name]:
        raise ValueError(f"{name}={value!r}: expected one of {', '.join(CHOICES[name])}")
    return text


def kernel_device_problem(kernel: str, device: str) -> str | None:
    """Why the forced ``kernel`` (``choice``'s value; "": none) cannot run on ``device``
    ("cpu" or "cuda"), in one line; None where it can."""
    if not kernel or device not in ("cpu", "cuda") or device in KERNEL_DEVICES[kernel]:
        return None
    others = ", ".join(k for k, on in KERNEL_DEVICES.items() if device in on)
    return (
        f"{KERNEL}={kernel} runs on {' or '.join(KERNEL_DEVICES[kernel])} only, and the ranks "
        f"compute on {device}: unset it (each block then gets the fastest kernel for its "
        f"device) or choose one of {others}"
    )
