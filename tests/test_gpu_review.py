"""What a first run on a GPU cluster would have hit (a review of the CUDA paths; no GPU here).

CUDA tensors are fake ones (FakeTensorMode on the CPU build) and the GPU's generation and
cuDNN's version are given, so these tests check the *choices* the engine makes for a GPU and
the arguments it passes flash-attn, not the kernels' numbers: those need a GPU
(tests/gpu, scripts/gpu-check)."""

from __future__ import annotations

import sys
import types
from typing import Optional

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from ringattn import kernels
from ringattn.comm import travels_batched
from ringattn.kernels import ChunkedKernel, TorchCUDAKernel, select_kernel


@pytest.fixture
def gpu(monkeypatch):
    """set(capability, cudnn): the GPU generation and cuDNN version the engine sees."""
    monkeypatch.setattr(kernels, "_CUDNN_USABLE", {})

    def set_(capability: tuple[int, int], cudnn: int = 91900) -> None:
        kernels._CUDNN_USABLE.clear()
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
        monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: True)
        monkeypatch.setattr(torch.backends.cudnn, "version", lambda: cudnn)

    return set_


def _cuda(*shape, dtype=torch.bfloat16) -> torch.Tensor:
    return torch.empty(*shape, device="cuda", dtype=dtype)


@pytest.mark.parametrize(
    "capability,cudnn,first",
    [
        ((9, 0), 91900, True),  # H100/H200 with a recent cuDNN: torch puts it first too
        ((10, 0), 91501, True),  # B200
        ((10, 3), 91900, True),  # B300 (second reading: torch takes sm103 too)
        ((9, 0), 91400, False),  # cuDNN before 9.15.1: torch does not put it first
        ((8, 0), 91900, False),  # A100: torch passes it over
        ((8, 9), 91900, False),  # L40S
        ((12, 0), 91900, False),  # consumer Blackwell
    ],
)
def test_cudnn_runs_the_ring_only_where_torch_itself_puts_it_first(gpu, capability, cudnn, first):
    """The ring called cuDNN's attention op on any sm80+ GPU with cuDNN 9: where torch's
    own selector passes it over on purpose (sm80/86/89, cuDNN before 9.15.1: wrong results
    and NaN gradients were reported for sequence lengths off its preferred multiples, and
    the ring's blocks are N/2P rows)."""
    gpu(capability, cudnn)
    with FakeTensorMode(allow_non_fake_inputs=True):
        q = _cuda(1, 512, 8, 128)
        assert TorchCUDAKernel().op_for(q, q) == ("cudnn" if first else "flash")


def test_torch_s_switch_that_keeps_cudnn_from_going_first_is_honoured(gpu, monkeypatch):
    gpu((9, 0))
    monkeypatch.setenv("TORCH_CUDNN_SDPA_DEPRIORITIZED", "1")
    with FakeTensorMode(allow_non_fake_inputs=True):
        q = _cuda(1, 512, 8, 128)
        assert TorchCUDAKernel().op_for(q, q) == "flash"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_gpu_before_ampere_is_never_given_the_flash_op(gpu, dtype):
    """fp16 on a V100 or T4 went to torch's flash op, which refuses anything before sm80
    ("Flash attention only supports gpu architectures in the range [sm80, sm121]"): every
    rank failed at its first block. fp16 takes the efficient op; bf16, which no fused op
    takes before sm80, the chunked matmul kernel."""
    gpu((7, 0))
    with FakeTensorMode(allow_non_fake_inputs=True):
        q = _cuda(1, 512, 8, 64, dtype=dtype)
        kernel = select_kernel(q)
        if dtype == torch.float16:
            assert kernel.name == "torch-cuda" and kernel.op_for(q, q) == "efficient"
        else:
            assert isinstance(kernel, ChunkedKernel)


@pytest.mark.parametrize(
    "head_dim,capability,takes",
    [(128, (8, 0), True), (12, (8, 0), False), (264, (8, 0), False), (128, (7, 5), False)],
)
def test_flash_attn_is_given_only_heads_its_private_functions_take(
    gpu, monkeypatch, head_dim, capability, takes
):
    """flash-attn pads a head dim that is not a multiple of 8 in its public functions only,
    takes at most 256, and needs an Ampere GPU: the ring calls its private ones."""
    gpu(capability, cudnn=0)

    class StandIn:  # flash-attn is not installed here; only the choice is checked
        name = "flash-attn"

    monkeypatch.setattr(kernels, "_flash_attn_available", lambda: True)
    monkeypatch.setattr(kernels, "FlashAttnKernel", StandIn)
    with FakeTensorMode(allow_non_fake_inputs=True):
        q = _cuda(1, 256, 4, head_dim, dtype=torch.float16)
        assert (select_kernel(q).name == "flash-attn") is takes


def test_cuda_blocks_travel_in_one_batched_call_whatever_the_backend_string():
    """A ring whose group was made by `init_process_group()` with no backend ("undefined")
    or "cpu:gloo,cuda:nccl" sent CUDA blocks by separate isend/irecv: NCCL then builds a
    communicator per pair at the first send, which waits for its peer, itself waiting to
    send to the next rank (a ring of them can hang). CUDA tensors always go batched; this
    cannot run NCCL itself (tests/gpu does, on one rank)."""
    with FakeTensorMode(allow_non_fake_inputs=True):
        assert travels_batched([_cuda(2, 2), _cuda(2, 2)])
    assert not travels_batched([torch.empty(2), torch.empty(2)])


# -- flash-attn >= 2.7: its private functions are torch.library.custom_op objects ---------------


def _reference(q, k, v, scale, causal):
    s = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double()) * scale
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    lse = s.logsumexp(-1)
    out = torch.einsum("bhqk,bkhd->bqhd", (s - lse[..., None]).exp(), v.double())
    return out, lse


@pytest.fixture
def flash_attn_2_8(monkeypatch):
    """A `flash_attn` package whose private functions have flash-attn 2.8's signatures and
    its custom_op wrapping, computing in float64 on the CPU (the arguments the adapter
    passes are what is checked; the numbers are the reference's)."""
    lib = f"ringctl_fa_{id(monkeypatch)}"

    @torch.library.custom_op(f"{lib}::_flash_attn_forward", mutates_args=())
    def _flash_attn_forward(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        dropout_p: float,
        softmax_scale: float,
        causal: bool,
        window_size_left: int,
        window_size_right: int,
        softcap: float,
        alibi_slopes: Optional[torch.Tensor],  # noqa: UP045 - custom_op reads typing's form
        return_softmax: bool,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        assert dropout_p == 0.0 and (window_size_left, window_size_right) == (-1, -1)
        out, lse = _reference(q, k, v, softmax_scale, causal)
        return out.to(q.dtype), lse.float(), torch.empty(0), torch.empty(2, dtype=torch.int64)

    @torch.library.custom_op(f"{lib}::_flash_attn_backward", mutates_args=("dq", "dk", "dv"))
    def _flash_attn_backward(
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        softmax_lse: torch.Tensor,
        dq: Optional[torch.Tensor],  # noqa: UP045
        dk: Optional[torch.Tensor],  # noqa: UP045
        dv: Optional[torch.Tensor],  # noqa: UP045
        dropout_p: float,
        softmax_scale: float,
        causal: bool,
        window_size_left: int,
        window_size_right: int,
        softcap: float,
        alibi_slopes: Optional[torch.Tensor],  # noqa: UP045
        deterministic: bool,
        rng_state: Optional[torch.Tensor] = None,  # noqa: UP045
    ) -> torch.Tensor:
        # autograd does not run inside a custom op's body: attention's gradients by hand
        qd, kd, vd, do = q.double(), k.double(), v.double(), dout.double()
        s = torch.einsum("bqhd,bkhd->bhqk", qd, kd) * softmax_scale
        if causal:
            s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
        p = s.softmax(-1)
        dp = torch.einsum("bqhd,bkhd->bhqk", do, vd)
        ds = p * (dp - (dp * p).sum(-1, keepdim=True))
        grads = (
            torch.einsum("bhqk,bkhd->bqhd", ds, kd) * softmax_scale,
            torch.einsum("bhqk,bqhd->bkhd", ds, qd) * softmax_scale,
            torch.einsum("bhqk,bqhd->bkhd", p, do),
        )
        for into, grad in zip((dq, dk, dv), grads, strict=True):
            into.copy_(grad)
        return torch.empty(0)

    interface = types.ModuleType("flash_attn.flash_attn_interface")
    interface._flash_attn_forward = _flash_attn_forward
    interface._flash_attn_backward = _flash_attn_backward
    package = types.ModuleType("flash_attn")
    package.flash_attn_interface = interface
    monkeypatch.setitem(sys.modules, "flash_attn", package)
    monkeypatch.setitem(sys.modules, "flash_attn.flash_attn_interface", interface)


@pytest.mark.parametrize("causal", [True, False])
def test_the_flash_attn_adapter_passes_its_arguments_to_flash_attn_2_8(flash_attn_2_8, causal):
    """inspect.signature of a custom_op is (*args, **kwargs): the adapter kept none of its
    arguments and every fp16/bf16 ring call on a GPU with flash-attn 2.7+ installed failed
    ("missing value for argument 'q'"). It reads the wrapped function's signature."""
    torch.manual_seed(0)
    q, k, v, dout = (torch.randn(1, 24, 2, 16) for _ in range(4))
    kernel = kernels.FlashAttnKernel()
    out, lse = kernel.forward(q, k, v, scale=0.25, causal=causal)
    want_out, want_lse = _reference(q, k, v, 0.25, causal)
    torch.testing.assert_close(out.double(), want_out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-5, atol=1e-6)
    dq, dk, dv = kernel.backward(dout, q, k, v, out, lse, scale=0.25, causal=causal)
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    ref, _ = _reference(*leaves, 0.25, causal)
    grads = torch.autograd.grad(ref, leaves, dout.double())
    for got, want in zip((dq, dk, dv), grads, strict=True):
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "listed,threads,sharers,bound",
    [
        ("0", "1", 1, [0]),  # its GPU's CPUs hold its threads: bound
        ("0-1,7000", "2", 1, [0, 1]),  # within the CPUs this rank may use
        ("0-1", "1", 2, [0, 1]),  # two ranks of one thread share two CPUs
        ("1", "2", 1, None),  # fewer than its threads: left as it was
        ("0", "1", 2, None),  # two ranks' threads on one CPU (second reading): left
        ("7000-7001", "1", 1, None),  # none of them this rank's (Slurm's cpuset): left
        ("n1:0", "1", 1, None),  # not a CPU list
    ],
)
def test_a_rank_is_bound_to_its_gpu_s_cpus_where_they_hold_its_threads(
    listed, threads, sharers, bound
):
    """(GPU review) The plan exported RINGCTL_CPU_AFFINITY (nvidia-smi's CPU Affinity of the
    rank's GPU) and nothing applied it: a rank could run on the socket far from its GPU.
    Checked in a child process (the binding is real, sched_setaffinity)."""
    import os
    import subprocess

    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two CPUs to tell a binding from none")
    code = (
        "import os; from ringctl.worker import bind_to_gpu_cpus; "
        f"said = bind_to_gpu_cpus({listed!r}, {sharers}); "
        "print(sorted(os.sched_getaffinity(0))); print(said)"
    )
    env = {**os.environ, "OMP_NUM_THREADS": threads}
    env.pop("PYTHONPATH", None)
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    cpus, said = done.stdout.splitlines()
    before = sorted(os.sched_getaffinity(0))
    if bound is None:
        assert cpus == str(before) and "not bound" in said, (cpus, said)
    else:
        assert cpus == str(bound) and "bound to" in said, (cpus, said)


@pytest.mark.parametrize(
    "world,layout,degree",
    [(1, "zigzag", 1), (4, "zigzag", 1), (5, "contiguous", 1), (4, "hybrid-zigzag", 2)],
)
def test_each_rank_draws_only_its_share_of_the_attention_task_s_inputs(
    monkeypatch, world, layout, degree
):
    """(GPU review) Every rank drew the whole sequence's q, k, v and output gradient in
    float64 and kept its shard (jobs/attention.yaml: 20 GiB and ~90 s a rank). A rank now
    draws the chunks its rows fall in, and its rows are the whole draw's rows at its
    positions, the reference's (which draws them all)."""
    from ringattn import sequence_positions
    from ringctl.config import load_job
    from ringctl.tasks import attention

    cfg = load_job("jobs/smoke.yaml", ["task.seq_len=5000", "task.heads=2", "task.kv_heads=1"])
    whole = attention.make_inputs(cfg)
    assert [whole[n].shape[1] for n in attention.INPUT_NAMES] == [5000] * 4
    assert whole["k"].shape[2] == 1 and whole["q"].shape[2] == 2
    drawn = []
    chunk = attention._chunk
    monkeypatch.setattr(attention, "_chunk", lambda *a: drawn.append(a[2]) or chunk(*a))
    where = {"world_size": world, "layout": layout}
    if degree > 1:
        where["ulysses_degree"] = degree
    for rank in range(world):
        positions = sequence_positions(5000, rank=rank, **where)
        drawn.clear()
        mine = attention.make_inputs(cfg, positions)
        for name in attention.INPUT_NAMES:
            assert torch.equal(mine[name], whole[name][:, positions]), (rank, name)
        needed = set((positions // attention.INPUT_CHUNK).tolist())
        assert sorted(set(drawn)) == sorted(needed) and len(drawn) == 4 * len(needed)


def test_ranks_whose_gpus_share_a_cpu_list_are_counted_together():
    """(second reading) Each rank checked its GPU's CPUs against its own threads only: on a
    DGX the two ranks of a GPU pair bound to one 32-CPU list with 32 threads each, the
    node's other CPUs idle. The plan's ranks of one node with the same list are counted."""
    from ringctl.topology import load_node_files, plan_ring
    from ringctl.worker import Identity, cpu_sharers
    from tests.topo_fixtures import DGX

    plan = plan_ring([load_node_files(DGX, name="dgx")])
    lists = [e.env["RINGCTL_CPU_AFFINITY"] for e in plan.ring]
    for entry in plan.ring:
        ident = Identity("dgx", entry.local_rank, 0, entry.rank, len(plan.ring), "x", 1)
        ident.plan_entry, ident.placement = {"env": dict(entry.env)}, plan
        assert cpu_sharers(ident) == lists.count(entry.env["RINGCTL_CPU_AFFINITY"]) > 1
    assert cpu_sharers(Identity("n", 0, 0, 0, 1, "x", 1)) == 1  # no plan


def test_an_unpinned_rank_takes_its_gpu_among_the_job_s_own():
    """(second reading) A PCIe node's rank sees every GPU Slurm gave the job, which sets
    CUDA_VISIBLE_DEVICES to them (4,5,6,7 of 8): the plan's nvidia-smi index 5 is ordinal
    1 there, and a GPU the job was not given is refused by name, not taken (index 1 was
    ordinal 1: physical GPU 5, which the plan did not price)."""
    from ringctl.worker import WorkerError, cuda_index

    assert cuda_index({"gpu": 5, "env": {}}, 0, 4, "4,5,6,7") == 1
    assert cuda_index({"gpu": 4, "env": {}}, 0, 2, "02, 04") == 1  # as CUDA reads them
    with pytest.raises(WorkerError, match="GPU 1; CUDA_VISIBLE_DEVICES gives it 4,5,6,7"):
        cuda_index({"gpu": 1, "env": {}}, 0, 4, "4,5,6,7")
    assert cuda_index({"gpu": 3, "env": {}}, 0, 8, None) == 3  # every GPU visible
    assert cuda_index({"gpu": 3, "env": {}}, 0, 8, "GPU-1a2b,GPU-3c4d") == 3  # UUIDs: as before


def test_a_node_of_bridged_pairs_keeps_its_gpus_in_sight():
    """(second reading) Pinning was kept where any two GPUs share NVLink: on a node of
    bridged pairs the ring's hops between pairs (SYS) went through host memory. Pinned only
    where every two GPUs are NVLinked."""
    from ringctl.topology import load_node_files, plan_ring
    from ringctl.topology.placement import pins_gpu
    from tests.topo_fixtures import DGX, OLD

    old = load_node_files(OLD, name="old")
    assert old.nvlinked and not old.all_nvlinked and not pins_gpu(old)
    assert all("CUDA_VISIBLE_DEVICES" not in e.env for e in plan_ring([old]).ring)
    assert pins_gpu(load_node_files(DGX, name="dgx"))
