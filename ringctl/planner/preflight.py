"""The plan a job gets before it is submitted: refuse what cannot fit, warn what will crawl.

``Preflight`` is the verdict. Reading a job config into a workload is not the planner's
business (the planner is a leaf: it imports neither the tasks nor the config); it lives in
``ringctl.sizing.Sizing.preflight``, which also honours ``ring.size`` and ``model.shard``.

"""

from __future__ import annotations

from dataclasses import dataclass

from .cost import Estimate


@dataclass
class Preflight:
    device: str
    estimate: Estimate

    @property
    def reason(self) -> str:
        return "; ".join(self.estimate.warnings)
