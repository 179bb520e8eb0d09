"""The plan a job gets before it is submitted: refuse what cannot fit, warn what will crawl.

A task that can say what it will run defines ``workload(cfg) -> Workload | None`` (the
attention task does; a long-document job's lengths are only known once documents are read).
The device is the job's ``device`` key (a device table entry); without one, GPU jobs are not
checked and CPU jobs use this machine's calibrated entry when there is one.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass

from .cost import Estimate, estimate, nominal_link
from .devices import load_devices


@dataclass
class Preflight:
    device: str
    estimate: Estimate

    @property
    def reason(self) -> str:
        return "; ".join(self.estimate.warnings)


def preflight(cfg) -> Preflight | None:
    from ..config import world_size
    from ..tasks import get_spec

    make_workload = getattr(get_spec(str(cfg.task.name)).module, "workload", None)
    work = make_workload(cfg) if make_workload else None
    if work is None:
        return None
    devices = load_devices()
    name = cfg.get("device")
    if not name and int(cfg.gpus_per_node) == 0:
        name = f"cpu-{socket.gethostname().split('.')[0]}"
    if not name or name not in devices:
        return None
    device = devices[name]
    ranks = world_size(cfg)
    link = nominal_link(device, int(cfg.nodes))
    ranks_on_host = int(cfg.tasks_per_node)
    return Preflight(name, estimate(work, ranks, device, link, ranks_on_host=ranks_on_host))
