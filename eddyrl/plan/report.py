"""A memory plan as people and programs read it: `format_plan` (Markdown tables, one per kind
of device, terms in GiB) and `plan_dict` (JSON-ready)."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from .fixes import over_roles
from .memory_plan import GIB, DevicePlan, MemoryPlan


def gib(value: int) -> str:
    """GiB with two decimals, three under 1 GiB (a tiny model's terms are MBs)."""
    return f"{value / GIB:.2f}" if abs(value) >= GIB else f"{value / GIB:.3f}"


def plan_dict(plan: MemoryPlan) -> dict[str, Any]:
    return {
        "model": plan.model, "parameters": plan.parameters, "fits": plan.fits,
        "devices": [{"label": d.label, "count": d.count, "memory": asdict(d.memory),
                     "sharing": d.sharing, "processes": d.processes, "peak": d.peak,
                     "margin": d.margin, "reserve": d.reserve, "fits": d.fits,
                     "roles": [asdict(r) for r in d.roles]} for d in plan.devices],
        "fixes": [asdict(f) for f in plan.fixes],
    }


def _role_header(device: DevicePlan, role: str) -> str:
    processes = device.processes[role]
    return f"{role} (x{processes})" if processes > 1 else role


def _device_table(device: DevicePlan) -> list[str]:
    memory = device.memory
    how = {"own": "", "turns": " (the roles take turns: the larger peak counts)",
           "shared": " (every process at once: the peaks add)"}[device.sharing]
    lines = [f"{device.label}: {device.count} x {memory.name}, {gib(memory.bytes)} GiB "
             f"({memory.source}){how}", "",
             "| GiB | " + " | ".join(_role_header(device, r.role) for r in device.roles) + " |",
             "|---" * (len(device.roles) + 1) + "|"]
    terms: list[str] = []
    for role in device.roles:
        terms += [t for t in role.terms if t not in terms]
    for term in terms:
        cells = [gib(r.terms[term]) if term in r.terms else "" for r in device.roles]
        lines.append(f"| {term} | " + " | ".join(cells) + " |")
    lines.append("| **peak** | " + " | ".join(f"**{gib(r.peak)}**" for r in device.roles) + " |")
    verdict = "fits" if device.fits else "DOES NOT FIT"
    lines += ["", f"device peak {gib(device.peak)} GiB of {gib(memory.bytes)} GiB: margin "
              f"{gib(device.margin)} GiB ({device.margin / memory.bytes:.0%}; at least "
              f"{gib(device.reserve)} GiB kept free) -> {verdict}"]
    for role in device.roles:
        lines += _details(role.role, role.details)
        if role.refused:
            lines.append(f"{role.role} CANNOT START: {role.refused}")
    return lines


def _details(role: str, details: dict[str, Any]) -> list[str]:
    if role == "train":
        buddy = f" ({gib(details['buddy_bytes'])} GiB of it buddy copies)" \
            if details.get("buddy_bytes") else ""
        host = f", {gib(details['host_bytes'])} GiB in host memory{buddy}" \
            if details.get("host_bytes") else ""
        moment = f"; the peak at the {details['moment']}" if details.get("moment") else ""
        return [f"train: {details['tokens_per_micro_batch']} tokens per micro-batch "
                f"({details['rows_per_micro_batch']} rows), attention {details['attention']}"
                f"{host}{moment}"]
    engine = f"rollout ({details['engine']}, {details['dtype']}, context " \
        f"{details['max_model_len']} tokens)"
    at_once = f"{details['concurrent_sequences']} sequences of the longest " \
        f"({details['longest']} tokens) at once"
    if details.get("memory_fraction"):
        return [f"{engine}: {details['memory_fraction']:.0%} of the device, a KV pool of "
                f"{details['kv_tokens']} tokens: {at_once} (at most "
                f"{details['max_batch_size']} decoding together)"]
    per_sequence = details["kv_tokens"] // details["max_batch_size"]
    return [f"{engine}: KV cache {details['kv_tokens']} tokens "
            f"({details['max_batch_size']} sequences x {per_sequence} tokens): {at_once}"]


def format_plan(plan: MemoryPlan) -> str:
    count = f"{plan.parameters / 1e9:.2f} B" if plan.parameters >= 1e9 \
        else f"{plan.parameters / 1e6:.2f} M"
    lines = [f"model: {plan.model} ({count} parameters)", ""]
    for device in plan.devices:
        lines += _device_table(device) + [""]
    if plan.fixes:
        lines.append("cheapest fixes, in order (each on top of the ones before):")
        for number, fix in enumerate(plan.fixes, 1):
            lines.append(f"  {number}. {fix.override}: {fix.why} -> {fix.role} peak "
                         f"{gib(fix.peak)} GiB{' (fits)' if fix.fits else ''}")
        if not plan.fixes[-1].fits:
            lines.append("  still over after them: nothing in the config lowers it further "
                         "(a device with more memory, or a smaller model)")
    if not plan.fits and not plan.fixes:
        lines.append("no setting in the config lowers it further (a device with more memory, "
                     "or a smaller model)")
    over = ", ".join(sorted(over_roles(plan.devices)))
    lines.append("fits" if plan.fits else f"does not fit ({over})")
    return "\n".join(lines)
