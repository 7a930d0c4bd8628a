"""PNG plots of a bench run (matplotlib, the optional `bench` extra), drawn from the suites' results.

Each plot reads one suite's results as run_suite wrote them; a plot whose suite did not run (or
ran without the figures it needs) is left out with the reason before any figure is made, and
without matplotlib no plot is drawn and the report says how to install it. Rendering is
headless (the Agg backend).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

Results = Mapping[str, Mapping[str, Any]]      # suite name -> its results


@dataclass(frozen=True)
class Plot:
    suite: str                                   # the suite whose results it reads
    select: Callable[[Mapping[str, Any]], Any]   # its results -> the plot's data (empty: not there)
    draw: Callable[[Any, Any], None]             # (axes, data)
    needs: str                                   # what the data is, for "not drawn" reasons


def _restore_vs_cold(ax: Any, rows: list[dict[str, Any]]) -> None:
    ctx = [x["context_tokens"] for x in rows]
    ax.plot(ctx, [x["cold_s"] * 1e3 for x in rows], "o-", label="cold start (open + re-prefill)")
    ax.plot(ctx, [x["restore_s"] * 1e3 for x in rows], "o-", label="restore from a capsule")
    ax.set(xscale="log", yscale="log", xlabel="context (tokens)", ylabel="to first token (ms)",
           title="restore vs cold start, fresh process")


def _tokenize_append(ax: Any, rows: list[dict[str, Any]]) -> None:
    for fam in dict.fromkeys(x["family"] for x in rows):
        mine = [x for x in rows if x["family"] == fam]
        chars = [x["context_chars"] for x in mine]
        ax.plot(chars, [x["p50_ms"] for x in mine], "o-", label=f"{fam}: append (p50)")
        ax.plot(chars, [x["full_encode_ms"] for x in mine], "s--", label=f"{fam}: full re-encode")
    ax.set(xscale="log", yscale="log", xlabel="text (characters)", ylabel="ms per append",
           title="incremental append vs full re-tokenization")


def _ttft_vs_k(ax: Any, rows: list[dict[str, Any]]) -> None:
    k = [x["k"] for x in rows]
    ax.plot(k, [x["injected_ttft_ms"] for x in rows], "o-", label="facts injected (memory_k)")
    ax.plot(k, [x["prefill_ttft_ms"] for x in rows], "s--", label="facts prefilled as text")
    ax.set(xlabel="facts k", ylabel="time to first token (ms)", title="TTFT vs k")


def _step_samples(stall: Mapping[str, Any]) -> dict[str, list[float]] | None:
    samples = {k: stall.get(k, {}).get("work_ms") for k in ("without", "with")}
    return samples if all(samples.values()) else None


def _step_histogram(ax: Any, samples: dict[str, list[float]]) -> None:
    lo = min(min(xs) for xs in samples.values())
    hi = max(max(xs) for xs in samples.values())
    bins = [lo + (hi - lo) * i / 40 for i in range(41)]           # the same bins for both runs
    for name, xs in samples.items():
        ax.hist(xs, bins=bins, alpha=0.6, label=f"{name} checkpoint(wait=False) every step")
    ax.set(xlabel="step time (ms): decode one token + the capsule", ylabel="steps",
           title="100 Hz loop step time, builtin:tiny")


def _bytes_per_epoch(ax: Any, rows: list[dict[str, Any]]) -> None:
    ep = [x["epoch"] for x in rows]
    ax.plot(ep, [x["bytes_written"] / 1e3 for x in rows], "o-", label="written (delta)")
    ax.plot(ep, [x["new_token_bytes"] / 1e3 for x in rows], "s--", label="K/V of the new tokens")
    ax.set(yscale="log", xlabel="epoch", ylabel="kB", title="bytes per epoch, +8 tokens a step")
    ax.text(0.02, 0.02, f"full state {rows[-1]['full_state_bytes'] / 1e6:.1f} MB", transform=ax.transAxes)


PLOTS: dict[str, Plot] = {
    "restore_vs_cold.png": Plot("capsules", lambda r: r.get("restore", {}).get("contexts"), _restore_vs_cold,
                                "its restore section"),
    "tokenize_append.png": Plot("tokenize", lambda r: r.get("runs"), _tokenize_append, "its runs"),
    "ttft_vs_k.png": Plot("memory", lambda r: r.get("ttft"), _ttft_vs_k, "its ttft section"),
    "step_time_hist.png": Plot("capsules", lambda r: _step_samples(r.get("stall", {})), _step_histogram,
                               "its control-loop stall section"),
    "bytes_per_epoch.png": Plot("capsules", lambda r: r.get("delta", {}).get("per_epoch"), _bytes_per_epoch,
                                "its delta section"),
}


def draw_plots(results: Results, out_dir: Path) -> dict[str, str]:
    """file name -> "ok" or why it was not drawn; the PNGs go into out_dir."""
    data: dict[str, Any] = {}
    done: dict[str, str] = {}
    for name, plot in PLOTS.items():
        got = plot.select(results[plot.suite]) if plot.suite in results else None
        if got:
            data[name] = got
        else:
            done[name] = (f"needs the {plot.suite} suite" if plot.suite not in results
                          else f"needs the {plot.suite} suite ({plot.needs})")
    if not data:
        return done
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return {**done, **{n: "matplotlib is not installed: pip install 'exec-capsules[bench]'" for n in data}}
    for name, got in data.items():
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        try:
            PLOTS[name].draw(ax, got)
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8)
            fig.tight_layout()
            fig.savefig(out_dir / name, dpi=110)
            done[name] = "ok"
        except (KeyError, TypeError, ValueError) as exc:   # a suite's results in another shape
            done[name] = f"could not draw: {type(exc).__name__}: {exc}"
        finally:
            plt.close(fig)
    return {name: done[name] for name in PLOTS}
