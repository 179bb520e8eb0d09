"""`ringctl plan`'s tables: what the planner found, in the order a user decides by (does it
fit, in what dtype, how long, what to change)."""

from __future__ import annotations

from .cost import GIB
from .window import layer_windows


def _console():
    from ..terminal import console

    return console()


def _memory_table(est):
    from rich.table import Table

    mem = Table(title="memory per rank", show_footer=True)
    mem.add_column("held by", footer="total / usable")
    mem.add_column(
        "GiB",
        justify="right",
        footer=f"{est.memory_total_gib:.2f} / {est.memory_capacity_gib:.1f}",
    )
    for name, value in est.memory_bytes.items():
        mem.add_row(name, f"{value / GIB:.3f}")
    return mem


def _rate_line(est, device) -> str:
    if device.cores is not None:  # a calibrated CPU: measured rates, no datasheet peak
        rate = device.tflops[est.precision["weights (compute)"]]
        widths = device.matmul_tflops_by_width
        measured = (
            f"matmul rates by width, {1e3 * min(widths.values()):.1f}-{1e3 * rate:.1f}"
            if widths
            else f"matmul rate, {1e3 * rate:.1f}"
        )
        return (
            f"tokens/s per rank: {est.tokens_per_s_per_gpu:,.1f} (this host's measured "
            f"{measured} GFLOP/s per rank)"
        )
    return (
        f"tokens/s per GPU: {est.tokens_per_s_per_gpu:,.1f}; MFU: {100 * est.mfu:.1f}% "
        f"(matmuls at {device.matmul_efficiency:.0%} of peak, attention "
        f"{device.attention_efficiency[0]:.0%}/{device.attention_efficiency[1]:.0%})"
    )


def _precision_table(est):
    from rich.table import Table

    table = Table(title="mixed precision (dtype per tensor kind)")
    table.add_column("tensor")
    table.add_column("dtype")
    for kind, dtype in est.precision.items():
        table.add_row(kind, dtype)
    return table


def _ring_table(est):
    from rich.table import Table

    title = "one ring step (slowest rank)"
    if est.ulysses > 1:
        title += f", ring of {est.ranks // est.ulysses} Ulysses groups"
    steps = Table(title=title)
    steps.add_column("phase")
    for col in ("compute ms", "transfer ms", "hidden", "min tokens/rank", "attention s"):
        steps.add_column(col, justify="right", no_wrap=True)
    for phase in est.step_compute_s:
        need = est.min_tokens_per_rank_for_overlap.get(phase)
        steps.add_row(
            phase,
            f"{1e3 * est.step_compute_s[phase]:.2f}",
            f"{1e3 * est.step_transfer_s[phase]:.2f}",
            "yes" if est.overlapped[phase] else "[red]NO[/]",
            f"{need:,}" if need else "",
            f"{est.total_s[phase]:.4g}",
        )
    if "forward+backward" in est.total_s:
        steps.add_row("fwd+bwd", "", "", "", "", f"{est.total_s['forward+backward']:.4g}")
    return steps


def _model_table(est):
    from rich.table import Table

    table = Table(title="whole model, one sequence", show_footer=True)
    table.add_column("part", footer="total")
    table.add_column("s", justify="right", footer=f"{est.model_total_s:.4g}")
    for part, seconds in est.model_s.items():
        if seconds:
            table.add_row(part, f"{seconds:.4g}")
    return table


def _layout_table(layouts):
    from rich.table import Table

    from .hybrid import explain, recommend

    best = recommend(layouts)
    table = Table(title="sequence-parallel layout (same ranks)")
    for col in ("layout", "ring steps", "fits", "ring hidden", "seconds", ""):
        table.add_column(col, justify="left" if col == "layout" else "right")
    for o in layouts:
        hidden = all(o.estimate.overlapped.values())
        table.add_row(
            o.name,
            str(o.ring),
            "yes" if o.estimate.fits else "[red]no[/]",
            "yes" if hidden else "[red]no[/]",
            f"{o.seconds:.4g}",
            "[bold]recommended[/]" if o is best else "",
        )
    notes = [explain(layouts[0], o) for o in layouts[1:]]
    return table, notes


def print_plan(work, est, device, link, longest, fewest, layouts=()) -> None:
    console = _console()
    mask = "causal" if work.causal else "full"
    windows = layer_windows(work)
    if windows[0][0] is not None:
        mask = f"causal, sliding window {windows[0][0]:,} on {windows[0][1]} layer(s),"
    model = f", {work.model.name or 'model'} x{work.model.layers} layers" if work.model else ""
    shard = f", shard {work.shard} over {est.shard_degree}" if work.shard != "none" else ""
    console.print(
        f"[bold]{work.seq_len:,} tokens[/], {est.mode}{model}, {mask} {work.layout}, "
        f"{work.dtype}, checkpoint {work.checkpoint}{shard}; {est.ranks} ranks x "
        f"{est.tokens_per_rank:,} tokens on {device.name}; bottleneck hop: {link.name} "
        f"{link.gbit_s:g} Gbit/s, {1e6 * link.latency_s:g} us"
    )
    console.print(_memory_table(est))
    if est.memory_phases_gib:
        phases = ", ".join(f"{k} {v:.2f}" for k, v in est.memory_phases_gib.items())
        console.print(f"transients by phase (GiB; the largest is in the table): {phases}")
    console.print(_precision_table(est))
    console.print(_ring_table(est))
    if est.model_total_s is not None:
        console.print(_model_table(est))
        console.print(_rate_line(est, device))
    elif work.model is not None:
        console.print(
            f"whole-model time: {device.name} has no matmul throughput for {work.dtype} (an "
            "entry calibrated before matmuls were timed: run ringctl plan --calibrate again)"
        )
    if layouts:
        table, notes = _layout_table(layouts)
        console.print(table)
        for note in notes:
            console.print(f"  {note}")
    s = "s" * (est.ranks != 1)
    console.print(f"longest sequence that fits on {est.ranks} rank{s}: {longest:,} tokens")
    if fewest is not None:
        console.print(f"fewest ranks that fit {work.seq_len:,} tokens (and split them): {fewest}")
    for warning in est.warnings:
        console.print(f"[yellow]warning:[/] {warning}")


def print_schedule(work, device, ring, budgets, lengths, spans) -> None:
    """``budgets``: (tokens per rank the device holds, the job's own ring.max_tokens_per_rank
    or None). The headline is the job's own budget beside the device's, and what a ring holds
    by the smaller (a job that gives its own was headlined with the device's: 2.85M where its
    ranks take 5,000)."""
    from ringattn.geometry import ring_capacity  # the job's own rule

    held, own = budgets
    runs = held if own is None else min(own, held)  # a budget past the device's is not held
    console = _console()
    said = f"at most {held:,} tokens per rank"
    if own is not None:
        said = f"ring.max_tokens_per_rank {own:,} (the device holds at most {held:,} a rank)"
    console.print(
        f"{work.run_mode}, {work.model.name or 'model'} on {device.name}: {said}; a ring of "
        f"{ring} holds documents up to {ring_capacity(ring, runs, work.layout):,} tokens"
    )
    if own is not None and own > held:
        console.print(
            f"[yellow]warning:[/] ring.max_tokens_per_rank {own:,} is more than one "
            f"{device.name} holds ({held:,} tokens a rank)"
        )
    if lengths:
        console.print(
            f"{len(lengths):,} documents, {sum(lengths):,} tokens, longest {max(lengths):,} "
            "(a model tokenizer's: bounds by UTF-8 bytes, counted where no ring holds one)"
        )
    for name, seconds in spans.items():
        console.print(f"predicted makespan, {name}: {seconds:.4g} s")


def print_corpus(result: dict) -> None:
    console = _console()
    console.print(
        f"{result['documents']:,} documents ({result['shortest']:,}..{result['longest']:,} "
        f"tokens, {result['tokens']:,} in all), {result['mode']}, {result['model']} on "
        f"{result['world']} x {result['device']}"
    )
    console.print(f"one ring of {result['world']}: makespan {result['one_ring_makespan_s']:,.0f} s")
    console.print(
        f"auto ring sizes:  makespan {result['auto_makespan_s']:,.0f} s "
        f"({result['speedup']:.2f}x); documents per ring size "
        f"{result['auto_documents_per_ring_size']}"
    )
    gpu = result["gpu_seconds"]
    console.print(f"GPU-seconds: one ring {gpu['one ring']:,.0f}, auto {gpu['auto']:,.0f}")
