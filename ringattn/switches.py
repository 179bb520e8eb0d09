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
CHOICES = {
    KERNEL: ("chunked", "flash", "torch", "torch-cpu", "torch-cuda"),
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
