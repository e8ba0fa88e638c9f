"""plan.explain(): the analysis as a table, one row per cross-stage edge, and each rank's arena."""
from __future__ import annotations

# What each mechanism in the table does, printed under it for the mechanisms a plan uses.
MECHANISM_LEGEND = {
    "static slot": "static placement: WRITE into a slot preallocated per microbatch in flight, fence, flag",
    "max slot + size": "static placement at the maxima: WRITE the tensor into a slot preallocated at the "
                       "maxima, WRITE its shape into the slot's size record, fence, flag",
    "dynamic (READ)": "dynamic allocation: a preallocated metadata slot + flag; the receiver allocates "
                      "and READs the data",
    "flag only": "no data: the flag tells the producer the consumer's backward is done with the slot",
}
COLUMNS = ("edge", "from->to", "tensor", "shape/dtype", "class", "bytes", "mechanism", "send", "why")


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.2f} MiB" if n >= 1 << 16 else f"{n} B"


def _shape(e) -> str:
    return f"{e.dtype}[{', '.join(str(s) for s in e.shape)}]"


def _row(e, stats: dict | None) -> list[str]:
    send = "zero-copy" if e.zero_copy else "copy"
    why = e.why
    if stats is not None and e.name in stats:
        st = stats[e.name]
        send = f"{st['zero_copy']}/{st['sends']} zero-copy"
        if st.get("copy_reason"):
            why = f"{st['copy_reason']} (planned: {e.why})" if st["copy_reason"] != e.why else e.why
    tensor = e.source if e.payload != "activation" else f"{e.source}: {e.producer_op}"
    return [f"{e.name} {'fwd' if e.direction == 'forward' else 'bwd'}", f"{e.producer}->{e.consumer}", tensor,
            _shape(e), e.cls, str(e.nbytes), e.mechanism, send, why]


def explain_table(plan, stats: dict | None = None) -> str:
    mode = f"training ({plan.schedule})" if plan.training else "inference"
    placement = "on" if plan.zero_copy else "off (copy mode)"
    lines = [f"plan: {plan.num_stages} stages, {plan.n_microbatches} microbatches in flight, {mode}, "
             + f"allocation-site placement {placement}"]
    rows = [list(COLUMNS)] + [_row(e, stats) for e in plan.edges]
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS) - 1)]
    for r in rows:
        lines.append("  ".join(c.ljust(w) for c, w in zip(r[:-1], widths)) + "  " + r[-1])
    lines.append("classes: " + "; ".join(sorted({f"{e.name}: {e.cls_why}" for e in plan.edges if e.cls != "static"}))
                 if any(e.cls != "static" for e in plan.edges) else "classes: every edge is static")
    used = sorted({e.mechanism for e in plan.edges})
    lines += [f"  {m}: {MECHANISM_LEGEND[m]}" for m in used]
    for s, m in enumerate(plan.memory):
        lines.append(f"stage {s} arena: {_mib(m.total)} = receive slots {_mib(m.receive_slots)} + metadata "
                     f"{_mib(m.metadata_slots)} + flags/control {_mib(m.control)} + send-side {_mib(m.send_tensors)}"
                     f" (+1/4 and 1 MiB for the allocator)")
    return "\n".join(lines)
