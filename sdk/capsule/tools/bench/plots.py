"""PNG plots of a bench run (matplotlib, the optional `bench` extra), drawn from the suites' results.

Each plot reads one suite's results as run_suite wrote them; a plot whose suite did not run (or
ran without the figures it needs) is left out with the reason, and without matplotlib no plot is
drawn and the report says how to install it. Rendering is headless (the Agg backend).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Mapping

Results = Mapping[str, Mapping[str, Any]]      # suite name -> its results
Draw = Callable[[Any, Results], str | None]     # (axes, results) -> None when drawn, else why not


def _restore_vs_cold(ax: Any, r: Results) -> str | None:
    rows = r.get("capsules", {}).get("restore", {}).get("contexts")
    if not rows:
        return "needs the capsules suite"
    ctx = [x["context_tokens"] for x in rows]
    ax.plot(ctx, [x["cold_s"] * 1e3 for x in rows], "o-", label="cold start (open + re-prefill)")
    ax.plot(ctx, [x["restore_s"] * 1e3 for x in rows], "o-", label="restore from a capsule")
    ax.set(xscale="log", yscale="log", xlabel="context (tokens)", ylabel="to first token (ms)",
           title="restore vs cold start, fresh process")
    return None


def _tokenize_append(ax: Any, r: Results) -> str | None:
    rows = r.get("tokenize", {}).get("runs")
    if not rows:
        return "needs the tokenize suite"
    for fam in dict.fromkeys(x["family"] for x in rows):
        mine = [x for x in rows if x["family"] == fam]
        chars = [x["context_chars"] for x in mine]
        ax.plot(chars, [x["p50_ms"] for x in mine], "o-", label=f"{fam}: append (p50)")
        ax.plot(chars, [x["full_encode_ms"] for x in mine], "s--", label=f"{fam}: full re-encode")
    ax.set(xscale="log", yscale="log", xlabel="text (characters)", ylabel="ms per append",
           title="incremental append vs full re-tokenization")
    return None


def _ttft_vs_k(ax: Any, r: Results) -> str | None:
    rows = r.get("memory", {}).get("ttft")
    if not rows:
        return "needs the memory suite (its ttft section)"
    k = [x["k"] for x in rows]
    ax.plot(k, [x["injected_ttft_ms"] for x in rows], "o-", label="facts injected (memory_k)")
    ax.plot(k, [x["prefill_ttft_ms"] for x in rows], "s--", label="facts prefilled as text")
    ax.set(xlabel="facts k", ylabel="time to first token (ms)", title="TTFT vs k")
    return None


def _step_histogram(ax: Any, r: Results) -> str | None:
    stall = r.get("capsules", {}).get("stall", {})
    samples = {k: stall.get(k, {}).get("work_ms") for k in ("without", "with")}
    if not all(samples.values()):
        return "needs the capsules suite (its control-loop stall section)"
    lo = min(min(xs) for xs in samples.values())
    hi = max(max(xs) for xs in samples.values())
    bins = [lo + (hi - lo) * i / 40 for i in range(41)]           # the same bins for both runs
    for name, xs in samples.items():
        ax.hist(xs, bins=bins, alpha=0.6, label=f"{name} checkpoint(wait=False) every step")
    ax.set(xlabel="step time (ms): decode one token + the capsule", ylabel="steps",
           title="100 Hz loop step time, builtin:tiny")
    return None


def _bytes_per_epoch(ax: Any, r: Results) -> str | None:
    rows = r.get("capsules", {}).get("delta", {}).get("per_epoch")
    if not rows:
        return "needs the capsules suite"
    ep = [x["epoch"] for x in rows]
    ax.plot(ep, [x["bytes_written"] / 1e3 for x in rows], "o-", label="written (delta)")
    ax.plot(ep, [x["new_token_bytes"] / 1e3 for x in rows], "s--", label="K/V of the new tokens")
    ax.set(yscale="log", xlabel="epoch", ylabel="kB", title="bytes per epoch, +8 tokens a step")
    ax.text(0.02, 0.02, f"full state {rows[-1]['full_state_bytes'] / 1e6:.1f} MB", transform=ax.transAxes)
    return None


PLOTS: dict[str, Draw] = {"restore_vs_cold.png": _restore_vs_cold, "tokenize_append.png": _tokenize_append,
                          "ttft_vs_k.png": _ttft_vs_k, "step_time_hist.png": _step_histogram,
                          "bytes_per_epoch.png": _bytes_per_epoch}


def draw_plots(results: Results, out_dir: Path) -> dict[str, str]:
    """file name -> "ok" or why it was not drawn; the PNGs go into out_dir."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return {name: "matplotlib is not installed: pip install 'exec-capsules[bench]'" for name in PLOTS}
    done: dict[str, str] = {}
    for name, draw in PLOTS.items():
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        try:
            why = draw(ax, results)
            if why is None:
                ax.grid(True, which="both", alpha=0.3)
                ax.legend(fontsize=8)
                fig.tight_layout()
                fig.savefig(out_dir / name, dpi=110)
        except (KeyError, TypeError, ValueError) as exc:   # a suite's results in another shape
            why = f"could not draw: {type(exc).__name__}: {exc}"
        finally:
            plt.close(fig)
        done[name] = "ok" if why is None else why
    return done
