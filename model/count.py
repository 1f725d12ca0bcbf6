"""Parameter counting on the meta device (nothing is allocated), and `odyssey model params`.

`count_parameters(config)` instantiates `OdysseyForCausalLM(config)` under ``torch.device("meta")`` and
sums ``numel`` per component. Active parameters = everything a token touches: all parameters except the
routed experts it does not select, i.e. routed experts count k/n of their size (k = num_experts_per_tok,
n = n_routed_experts). The embedding and LM head count as active (the usual convention).

Components: embedding, vision (the patch embedding, model/vision.py), kda, mla, attn_res (pseudo-queries +
their norm scales), norms (pre-sublayer and final RMSNorms), dense_ffn, shared_experts, routed_experts,
router, moe_latent (W_down, W_up and the latent RMSNorm of LatentMoE), head.
Buffers (e.g. the balancing bias) are not parameters.

CLI: ``odyssey model params --preset k3 [--json]`` -> `cli_main(["params", "--preset", "k3"])`.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass, field

import torch

from model.config import PRESETS, OdysseyConfig

COMPONENTS = ("embedding", "vision", "kda", "mla", "attn_res", "norms", "dense_ffn", "shared_experts",
              "routed_experts", "router", "moe_latent", "head")
ROUTED_PARAM_NAMES = ("w_gate_up", "w_down_experts")  # LatentMoE's stacked expert weights [n, ...]


@dataclass
class ComponentCount:
    total: int = 0
    active: int = 0


@dataclass
class ParamCount:
    """total / active parameter counts and the per-component breakdown (COMPONENTS order)."""

    total: int
    active: int
    breakdown: dict[str, ComponentCount] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"total": self.total, "active": self.active,
                "breakdown": {k: asdict(v) for k, v in self.breakdown.items()}}


def classify(name: str, config: OdysseyConfig) -> str:
    """Component of a parameter of OdysseyForCausalLM from its qualified name."""
    if name.startswith("lm_head."):
        return "head"
    if name.startswith("model.embed_tokens."):
        return "embedding"
    if name.startswith("model.vision."):
        return "vision"  # PatchEmbed: patch projection + 2-D position gain (active: image tokens use it)
    if name.startswith("model.final_read."):
        return "attn_res"
    if name.startswith("model.norm."):
        return "norms"
    parts = name.split(".")
    if parts[:2] != ["model", "layers"]:
        raise ValueError(f"count_parameters: unclassified parameter {name!r}; extend model.count.classify")
    l, sub = int(parts[2]), parts[3]
    if sub == "mixer":
        return config.layer_types[l]
    if sub == "attn_res":
        return "attn_res"
    if sub in ("attn_norm", "ffn_norm"):
        return "norms"
    if sub == "mlp":
        if l not in config.moe_layer_indices:
            return "dense_ffn"
        rest = parts[4]
        if rest in ROUTED_PARAM_NAMES:
            return "routed_experts"
        if rest == "router":
            return "router"
        if rest == "shared_experts":
            return "shared_experts"
        return "moe_latent"
    raise ValueError(f"count_parameters: unclassified parameter {name!r}; extend model.count.classify")


def count_parameters(config: OdysseyConfig) -> ParamCount:
    """Build the model on the meta device and count total / active parameters per component."""
    from model.modeling import OdysseyForCausalLM

    with torch.device("meta"):
        model = OdysseyForCausalLM(config)
    k_over_n = config.num_experts_per_tok / config.n_routed_experts if config.n_routed_experts else 0.0
    breakdown = {c: ComponentCount() for c in COMPONENTS}
    for name, p in model.named_parameters():
        comp = classify(name, config)
        n = p.numel()
        breakdown[comp].total += n
        breakdown[comp].active += round(n * k_over_n) if comp == "routed_experts" else n
    total = sum(c.total for c in breakdown.values())
    active = sum(c.active for c in breakdown.values())
    return ParamCount(total, active, breakdown)


def _human(n: int) -> str:
    for unit, div in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:.3g}{unit}"
    return str(n)


def render_table(name: str, pc: ParamCount) -> None:
    """Print the breakdown with rich."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"odyssey model params: preset {name}")
    for col in ("component", "total", "active", "% of total", "% of active"):
        table.add_column(col, justify="left" if col == "component" else "right")
    for comp, c in pc.breakdown.items():
        if c.total == 0:
            continue
        table.add_row(comp, f"{c.total:,} ({_human(c.total)})", f"{c.active:,} ({_human(c.active)})",
                      f"{100 * c.total / pc.total:.2f}", f"{100 * c.active / pc.active:.2f}")
    table.add_row("TOTAL", f"{pc.total:,} ({_human(pc.total)})", f"{pc.active:,} ({_human(pc.active)})",
                  "100.00", "100.00", style="bold")
    console = Console()
    if console.width < 110:  # keep one line per row when piped / in narrow terminals
        console = Console(width=110)
    console.print(table)


def cli_main(argv: list[str]) -> int:
    """`odyssey model params --preset NAME [--json]` (argv is what follows "odyssey model")."""
    parser = argparse.ArgumentParser(prog="odyssey model", description="Model utilities.")
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("params", help="count total / active parameters of a preset (meta device, no memory)")
    p.add_argument("--preset", required=True, choices=sorted(PRESETS), help="model preset")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)
    pc = count_parameters(OdysseyConfig.from_preset(args.preset))
    if args.json:
        print(json.dumps({"preset": args.preset, **pc.to_dict()}, indent=2))
    else:
        render_table(args.preset, pc)
    return 0


def main(argv: list[str] | None = None) -> int:  # pragma: no cover - `python -m model.count params ...`
    import sys

    return cli_main(sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
