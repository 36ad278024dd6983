"""``vllm-pd-size``: KV bytes per token and prompt, and the handoff floor per link.

    vllm-pd-size --model /models/Llama-3-70B --tokens 2000 --tokens 300 --link 100 --link 10
    vllm-pd-size --layers 80 --kv-heads 8 --head-dim 128 --kv-dtype bf16 --json

A table for people, ``--json`` for machines (``sizing.report``). Exit status
2 with a message naming the field for a model it cannot size. Pure: runs
with the base package (no vLLM, torch or NIXL).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

from vllm_pd_ext.tools.sizing.formula import (
    KVSpec,
    SizingError,
    dtype_bytes,
    load_config,
    report,
    spec_from_config,
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vllm-pd-size", description=__doc__.split("\n\n")[0])
    src = p.add_argument_group("the model (a config.json, or its numbers)")
    src.add_argument("--model", metavar="PATH", help="config.json, or a model directory")
    src.add_argument("--layers", type=int)
    src.add_argument("--kv-heads", type=int, help="KV heads (GQA); default: attention heads")
    src.add_argument("--head-dim", type=int)
    src.add_argument("--latent-dim", type=int, default=0,
                     help="MLA: latent KV width per layer (kv_lora_rank + qk_rope_head_dim)")
    src.add_argument("--kv-dtype", help="KV element type (bf16, fp16, fp32, fp8); default: the "
                     "config's torch_dtype")
    q = p.add_argument_group("the question")
    q.add_argument("--tokens", type=int, action="append", metavar="N",
                   help="prompt length; repeat (default: 2000)")
    q.add_argument("--link", type=float, action="append", metavar="GB_S",
                   help="effective link bandwidth in GB/s (1e9 B/s); repeat (default: 100 25 10)")
    q.add_argument("--setup-ms", type=float, default=None,
                   help="per-handoff setup term (default: 1, or the measured one)")
    q.add_argument("--budget-ms", type=float, default=20.0, help="handoff budget to check")
    q.add_argument("--short-tokens", type=int, default=300,
                   help="the short-prompt case, on the slowest link; 0: leave out")
    q.add_argument("--sensitivity-dtype", default="fp8",
                   help="also size the KV in this dtype; '' to leave out")
    m = p.add_argument_group("measuring our transport here (needs the nixl extra)")
    m.add_argument("--measure", action="store_true",
                   help="READ 64 KiB, 4 MiB and 64 MiB between two processes over NIXL on "
                   "this host and add the measured bandwidth (and setup term) as a link")
    m.add_argument("--measure-reps", type=int, default=5, metavar="N")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    return p


def spec_from_args(args: argparse.Namespace) -> KVSpec:
    if args.model:
        return spec_from_config(load_config(args.model), args.kv_dtype, source=args.model)
    missing = [f"--{k.replace('_', '-')}" for k in ("layers", "kv_dtype")
               if getattr(args, k) is None]
    if args.head_dim is None and not args.latent_dim:
        missing.append("--head-dim (or --latent-dim)")
    if args.kv_heads is None and not args.latent_dim:
        missing.append("--kv-heads")
    if missing:
        raise SizingError("without --model, give " + ", ".join(missing))
    for name in ("layers", "kv_heads", "head_dim"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            raise SizingError(f"--{name.replace('_', '-')}={value}: expected > 0")
    return KVSpec(layers=args.layers, kv_heads=args.kv_heads or 1,
                  head_dim=args.head_dim or args.latent_dim,
                  bytes_per_element=dtype_bytes(args.kv_dtype, "--kv-dtype"),
                  latent_dim=args.latent_dim)


def render(out: dict[str, Any]) -> str:
    spec = out["spec"]
    kind = (f"MLA latent {spec['latent_dim']}" if spec["latent_dim"] else
            f"{spec['kv_heads']} KV heads x {spec['head_dim']}")
    lines = [f"model: {spec['source']}: {spec['layers']} layers, {kind}, "
             f"{spec['bytes_per_element']} B/element",
             f"KV bytes per token: {out['bytes_per_token']:,}",
             f"handoff floor = setup {out['setup_ms']:g} ms + bytes / bandwidth; budget "
             f"{out['handoff_budget_ms']:g} ms", "",
             "| prompt tokens | KV bytes | MiB | link GB/s | bandwidth floor ms | handoff floor ms "
             "| within budget |", "|---|---|---|---|---|---|---|"]
    sections = [("", out["prompts"])]
    if "sensitivity" in out:
        sections.append((f" ({out['sensitivity']['kv_dtype']})", out["sensitivity"]["prompts"]))
    for tag, prompts in sections:
        for pr in prompts:
            for link in pr["links"]:
                lines.append(
                    f"| {pr['prompt_tokens']}{tag} | {pr['kv_bytes']:,} | {pr['kv_mib']:.1f} | "
                    f"{link['effective_bandwidth_gb_s']:g} | {link['bandwidth_floor_ms']:.4f} | "
                    f"{link['handoff_floor_ms']:.4f} | "
                    f"{'yes' if link['within_budget'] else 'no'} |")
    if "measured" in out:
        ms = out["measured"]
        pts = ", ".join(f"{p['bytes'] >> 10} KiB in {p['median_s'] * 1e3:.3f} ms"
                        for p in ms["points"])
        lines += ["", f"measured: {ms['effective_bandwidth_gb_s']:.3f} GB/s, setup "
                  f"{ms['setup_ms']:.4f} ms ({pts}; {ms['where']})"]
    if "short_prompt_case" in out:
        sc = out["short_prompt_case"]
        lines += ["", f"short prompt: {sc['prompt_tokens']} tokens at "
                  f"{sc['effective_bandwidth_gb_s']:g} GB/s: handoff floor "
                  f"{sc['handoff_floor_ms']:.4f} ms (compare with what prefilling it on D "
                  "would cost; a floor is not a tail latency)"]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        spec = spec_from_args(args)
        links = list(args.link or [100.0, 25.0, 10.0])
        setup_ms = 1.0 if args.setup_ms is None else args.setup_ms
        measured = None
        if args.measure:
            from vllm_pd_ext.tools.sizing.measure import measure

            measured = measure(reps=max(1, args.measure_reps))
            links.append(round(measured.effective_bandwidth_gb_s, 3))
            if args.setup_ms is None:
                setup_ms = measured.setup_ms
        out = report(spec, args.tokens or [2000], links, setup_ms, args.budget_ms,
                     args.short_tokens or None, args.sensitivity_dtype or None)
        if measured is not None:
            out["measured"] = {
                "effective_bandwidth_gb_s": measured.effective_bandwidth_gb_s,
                "setup_ms": measured.setup_ms, "where": measured.where,
                "points": [{"bytes": b, "median_s": t} for b, t in measured.points]}
    except SizingError as exc:
        print(f"vllm-pd-size: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    emit(json.dumps(out, indent=2) if args.json else render(out))


def emit(text: str) -> None:
    """Print ``text``; a reader that closed the pipe early (``| head``,
    ``| grep -q``) ends the command quietly with status 1, not a traceback."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        # Python's own recipe: point stdout at devnull so the interpreter's
        # final flush at exit cannot raise a second time.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise SystemExit(1) from None


if __name__ == "__main__":
    main()
