#!/usr/bin/env python3
"""Per-rank timeline of a train_imbalanced.py run: one panel per configuration.

    python benchmarks/plot_timeline.py benchmarks/results/train_imbalanced_<kind>_<date>.json
    python benchmarks/plot_timeline.py RESULT.json --steps 2 --out timeline.png

Each row is a rank; minibatches are laid end to end (each starts when the slowest rank of
the previous one finished, as in the run, which starts every minibatch together). Bars:
microbatches (shade by tokens), LB-Micro dummy microbatches, odc.sync and the optimizer
step; white space is idle time (waiting for peers). Times come from CUDA events on the
compute stream (GPU) or the CPU clock.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from _png import save_png


def draw(result: dict, out: Path, steps: int | None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    configs = list(result["results"])
    world = result["world_size"]
    fig, axes = plt.subplots(len(configs), 1, figsize=(12, 1.0 + 0.45 * world * len(configs)),
                             sharex=True, squeeze=False)
    max_tokens = result["args"]["max_tokens"]
    colours = {"dummy": "#bbbbbb", "sync": "#d62728", "optimizer": "#2ca02c"}
    for ax, name in zip(axes[:, 0], configs):
        res = result["results"][name]
        step_times = res["step_times_s"][:steps]
        offset = 0.0
        for k, step_time in enumerate(step_times):
            for rank in range(world):
                for what, start, end, tokens, *_docs in res["timelines"][rank][k]:
                    if what == "micro":
                        colour = plt.cm.Blues(0.35 + 0.6 * min(1.0, tokens / max_tokens))
                    else:
                        colour = colours[what]
                    ax.barh(rank, max(end - start, 1e-9), left=offset + start, height=0.7,
                            color=colour, edgecolor="black" if what == "micro" else colour, linewidth=0.3)
            offset += step_time
            ax.axvline(offset, color="black", linewidth=0.6, linestyle=":")
        bubble = res.get("bubble_rate")
        ax.set_title(f"{name}: {res['tokens_per_s']:.0f} tokens/s"
                     + (f", bubble {100 * bubble:.0f}%" if bubble is not None else ""), fontsize=9, loc="left")
        ax.set_yticks(range(world))
        ax.set_yticklabels([f"rank {r}" for r in range(world)], fontsize=8)
        ax.invert_yaxis()
    axes[-1, 0].set_xlabel("seconds (minibatches end to end; dotted: minibatch ends)")
    fig.legend(handles=[Patch(color=plt.cm.Blues(0.8), label="microbatch (darker: more tokens)"),
                        Patch(color=colours["dummy"], label="LB-Micro dummy"),
                        Patch(color=colours["sync"], label="odc.sync"),
                        Patch(color=colours["optimizer"], label="clip + optimizer")],
               loc="upper right", fontsize=8, ncol=4)
    fig.suptitle(f"{result['kind']} {result.get('model', '')}: per-rank timeline", fontsize=10, x=0.01,
                 ha="left")
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    save_png(fig, out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("result", type=Path, help="JSON written by benchmarks/train_imbalanced.py")
    p.add_argument("--out", type=Path, help="PNG path (default: beside the JSON, _timeline.png)")
    p.add_argument("--steps", type=int, default=None, help="draw only the first N timed minibatches")
    args = p.parse_args()
    result = json.loads(args.result.read_text())
    if "timelines" not in next(iter(result["results"].values())):
        sys.exit(f"{args.result} has no timelines (written by an older train_imbalanced.py)")
    out = args.out or args.result.with_name(args.result.stem + "_timeline.png")
    draw(result, out, args.steps)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
