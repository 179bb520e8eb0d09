"""Read node and network layouts and place the ring of ring attention on the fastest links.

Parsers (`nvidia_smi`, `ibstat`, `slurm`, `hostlist`) turn raw tool output into a
`NodeTopology` per node and a `SwitchTopology`; `placement.plan_ring` turns those into a
`RingPlan`, the JSON the workers read (`plan.load_plan`, `RingPlan.entry_for`,
`RingPlan.groups` for rings of rings). `gdr` models where the ring leaves a node (GPUDirect
RDMA or host bounce), `groups` how a job's ranks split into tight rings of N.
`hybrid_place.plan_hybrid` places a hybrid Ulysses x ring job (`RingPlan.ulysses`,
`RingPlan.ring_of_groups`), with the degree `ulysses` chooses from the domains and heads.
"""

from .gdr import GdrPolicy
from .hostlist import compress, expand
from .hybrid_place import plan_hybrid
from .links import DEFAULT_BANDWIDTHS
from .model import Gpu, Hca, Nic, NodeTopology, Port
from .nodes import build_node, load_node, load_node_files
from .placement import order_gpus, order_nodes, plan_ring
from .plan import Hop, RankEntry, RingGroup, RingOfGroups, RingPlan, UlyssesGroups, load_plan
from .slurm import SwitchTopology, parse_slurm_topology

__all__ = [
    "DEFAULT_BANDWIDTHS",
    "GdrPolicy",
    "Gpu",
    "Hca",
    "Hop",
    "Nic",
    "NodeTopology",
    "Port",
    "RankEntry",
    "RingGroup",
    "RingOfGroups",
    "RingPlan",
    "SwitchTopology",
    "UlyssesGroups",
    "build_node",
    "compress",
    "expand",
    "load_node",
    "load_node_files",
    "load_plan",
    "order_gpus",
    "order_nodes",
    "parse_slurm_topology",
    "plan_hybrid",
    "plan_ring",
]
