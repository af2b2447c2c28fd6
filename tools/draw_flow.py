"""Draw docs/flow.png, the README's picture of the train_deploy pipeline: its six stages, what each leaves
behind, and the registry's champion that serving reads. Run: .venv/bin/python tools/draw_flow.py"""

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch  # noqa: E402

STAGES = [
    ("corpus", "read, clean,\ntokenize, encode", "token files\ntokenizer\ncorpus report"),
    ("validation", "statistics vs\nthe champion's", "go, or stop\nbefore training\n(report, exit 3)"),
    ("training", "Llama-family LM,\nPaddle launcher", "checkpoints\nmetrics.jsonl\ntraining curves"),
    ("averaging", "average the\nlast K checkpoints", "averaged or\nlast checkpoint"),
    ("export", "Paddle Inference,\nONNX fp32, int8", "versioned bundle\nparity, latency\nmodel card"),
    ("registry", "gate, serving\ncheck", "model version\n@champion\nhistory, alerts"),
]
OUT = Path(__file__).resolve().parents[1] / "docs" / "flow.png"


def draw(path: Path = OUT) -> None:
    """Write the picture at 1050 px wide (10.5 in at 100 dpi)."""
    fig, ax = plt.subplots(figsize=(10.5, 3.6), dpi=100)
    ax.set_xlim(0, 10.5)
    ax.set_ylim(0, 4)
    ax.axis("off")
    width, gap, top = 1.42, 0.3, 3.75
    for i, (name, what, outputs) in enumerate(STAGES):
        x = 0.3 + i * (width + gap)
        ax.add_patch(FancyBboxPatch((x, top - 1.25), width, 1.2, boxstyle="round,pad=0.02,rounding_size=0.12",
                                    facecolor="#dbe9f6", edgecolor="#2b5d8a", linewidth=1.4))
        ax.text(x + width / 2, top - 0.35, name, ha="center", va="center", fontsize=12, weight="bold",
                color="#17324d")
        ax.text(x + width / 2, top - 0.85, what, ha="center", va="center", fontsize=8.5, color="#17324d")
        ax.text(x + width / 2, top - 1.45, outputs, ha="center", va="top", fontsize=8.5, color="#444444",
                linespacing=1.3)
        if i:
            ax.add_patch(FancyArrowPatch((x - gap + 0.03, top - 0.65), (x - 0.03, top - 0.65),
                                         arrowstyle="-|>", mutation_scale=14, color="#2b5d8a", linewidth=1.4))
    reg_x = 0.3 + (len(STAGES) - 1) * (width + gap) + width / 2
    serve_x, serve_y, half = 6.2, 0.4, 2.1
    ax.add_patch(FancyBboxPatch((serve_x - half, serve_y - 0.27), 2 * half, 0.54, boxstyle="round,pad=0.02",
                                facecolor="#e3f1df", edgecolor="#3b7a2e", linewidth=1.4))
    serving = "@champion → train-deploy serve (HTTP)\nand init_from: champion (warm start)"
    ax.text(serve_x, serve_y, serving, ha="center", va="center", fontsize=8.5,
            color="#1f4a17")
    ax.add_patch(FancyArrowPatch((reg_x, top - 2.35), (serve_x + half, serve_y), connectionstyle="arc3,rad=-0.25",
                                 arrowstyle="-|>", mutation_scale=14, color="#3b7a2e", linewidth=1.4))
    ax.text(0.3, serve_y, "kedro run --pipelines train_deploy\n(make run), one MLflow run", ha="left",
            va="center", fontsize=8.5, color="#555555")
    fig.savefig(path, dpi=100, facecolor="white")
    plt.close(fig)


if __name__ == "__main__":
    draw()
