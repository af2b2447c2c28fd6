"""Which engine and graph a host runs a bundle on: what the bundle ships, what the host can run, what is fastest.

A bundle (format 8) records its Paddle Inference graphs in ``bundle.json`` under ``graphs``, each with the
fused CPU kernels it uses and what that needs (``handoffs.ServerGraph``): ``server/`` uses Paddle's fused kernels
(``graph.py``), ``server_portable/`` only operators every CPU runs. The fused graph runs on GPU, and on a CPU
where the kernel probe passes (``probe.py``); otherwise the portable graph does. A format 7 bundle has only
the fused graph.

``backend="paddle"`` runs Paddle Inference on the graph the host can run; ``"onnx"`` ONNX Runtime.
With no backend pinned (``None`` or ``"auto"``), the fastest correct (float32) engine and graph the host can run
(the fused graph where it runs, the portable graph, ONNX Runtime fp32) is chosen from figures measured on this
host the first time the bundle is loaded here and cached per host, wheels and bundle (``host_speed.py``:
milliseconds per generated token of a short greedy generation); should that measurement fail, from the figures
measured at export (``latency.json``: milliseconds per new token of a greedy generation, else the forward pass's
p50 at the smallest batch). The choice and its figures are logged when the bundle is loaded. On GPU, Paddle
Inference's fused graph.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from train_deploy.export.edge import INT8_FILE, ONNX_FILE
from train_deploy.export.graph import FUSED_DIR, FUSED_KERNELS, PORTABLE_DIR, SERVER_MODEL
from train_deploy.export.host_speed import host_figures
from train_deploy.export.probe import KernelProbe, fused_kernels
from train_deploy.handoffs import BUNDLE_FILE, BundleMeta, DescriptionError, LatencyReport, ServerGraph, from_json

GRAPH_FORMS = {FUSED_DIR: "paddle_inference", PORTABLE_DIR: "paddle_portable"}
"""Each server graph's folder and its form's name in parity.json and latency.json."""
BACKENDS = ("auto", "paddle", "onnx")
FORM_FILES = {"paddle_inference": f"{FUSED_DIR}/{SERVER_MODEL}.pdiparams",
              "paddle_portable": f"{PORTABLE_DIR}/{SERVER_MODEL}.pdiparams", "onnx_fp32": f"edge/{ONNX_FILE}",
              "onnx_int8": f"edge/{INT8_FILE}"}
"""The weights file of each exported form, relative to the bundle."""


def graph_record(fused: bool) -> dict[str, Any]:
    """``bundle.json``'s ``graphs`` entry of the fused (``server/``) or the portable graph."""
    kernels = list(FUSED_KERNELS) if fused else []
    return {"kernels": kernels, "needs": [f"probe:{kernel}" for kernel in kernels]}


def bundle_graphs(folder: Path, meta: BundleMeta) -> dict[str, ServerGraph]:
    """The bundle's server graphs by folder: ``graphs`` of a format 8 bundle, the one fused graph of a format 7
    one. Raises :class:`DescriptionError` naming ``bundle.json`` and the key."""
    where = str(Path(folder) / BUNDLE_FILE)
    if meta.graphs is None:
        return {FUSED_DIR: from_json(ServerGraph, graph_record(True), where)}
    if not meta.graphs:
        raise DescriptionError(f"{where}: graphs: expected a mapping of the server graphs' folders")
    unknown = sorted(set(meta.graphs) - set(GRAPH_FORMS))
    if unknown:
        raise DescriptionError(f"{where}: graphs.{unknown[0]}: unknown graph (known: {', '.join(GRAPH_FORMS)})")
    return dict(meta.graphs)


@dataclass(frozen=True, slots=True)
class Choice:
    """What :func:`choose_engine` picked (``refusal`` set: nothing the host can run was asked for)."""

    backend: str
    form: str
    """parity.json's name of the form: ``paddle_inference``, ``paddle_portable``, ``onnx_fp32``."""
    graph: str | None
    """The Paddle Inference graph's folder (None for ONNX)."""
    why: str
    refusal: str | None = None


def choose_engine(folder: Path, meta: BundleMeta, backend: str | None, device: str, *,
                  measure: bool = True) -> Choice:
    """The engine and graph to load ``folder`` with on this host (module docstring); ``measure=False`` compares
    the export's figures without timing the candidates here."""
    backend = backend or "auto"
    if backend == "onnx":
        return Choice("onnx", "onnx_fp32", None, "ONNX Runtime (asked for)")
    graphs = bundle_graphs(folder, meta)
    probe = fused_kernels(device) if any(graph.kernels for graph in graphs.values()) else None
    runnable = sorted((name for name, graph in graphs.items() if not graph.kernels or probe.runs),
                      key=lambda name: not graphs[name].kernels)  # the fused graph first
    graph = runnable[0] if runnable else None
    if backend == "paddle" or device == "gpu":
        why = _graph_reason(graph, graphs, probe)
        if graph is None:
            return Choice("paddle", "", None, why, refusal=_refusal(folder, meta, probe))
        return Choice("paddle", GRAPH_FORMS[graph], graph, f"Paddle Inference, {why}"
                      + (" (asked for)" if backend == "paddle" else " (the device is a GPU)"))
    candidates: dict[str, str | None] = {GRAPH_FORMS[name]: name for name in runnable}
    if (Path(folder) / "edge" / ONNX_FILE).is_file():
        candidates["onnx_fp32"] = None
    if not candidates:
        return Choice("paddle", "", None, "", refusal=_refusal(folder, meta, probe))
    figures, basis = _figures(folder, meta, candidates, measure)
    form = min(candidates, key=lambda name: figures.get(name, float("inf")))
    if form not in figures:  # no figures: Paddle Inference when it can run, as before
        form = next(iter(candidates))
    engine = "ONNX Runtime fp32" if form == "onnx_fp32" else \
        f"Paddle Inference, {_graph_reason(candidates[form], graphs, probe)}"
    unrunnable = "" if probe is None or probe.runs else f"; not the fused graph: {probe.reason}"
    return Choice("onnx" if form == "onnx_fp32" else "paddle", form, candidates[form],
                  f"{engine}: the fastest this host runs {basis}" + (unrunnable if form == "onnx_fp32" else ""))


def _figures(folder: Path, meta: BundleMeta, candidates: dict[str, str | None],
             measure: bool) -> tuple[dict[str, float], str]:
    """The figures the candidates are compared by, and a phrase naming them: this host's (``host_speed.py``) when
    ``measure`` and there is a choice to make, else (or when measuring failed) the export's."""
    if measure and len(candidates) > 1 and (speed := host_figures(folder, meta, candidates)) is not None:
        return speed.ms_per_token, f"by its own figures ({speed.describe()})"
    figures, unit = speed_figures(folder, list(candidates))
    measured = ", ".join(f"{name} {value:.3g} {unit}" for name, value in figures.items()) or "no figures"
    return figures, f"at export's figures ({measured})"


def _graph_reason(graph: str | None, graphs: dict[str, ServerGraph], probe: KernelProbe | None) -> str:
    if graph is None:
        return f"no server graph this host can run ({probe.reason})"
    if graphs[graph].kernels:
        return f"fused graph ({graph}/: {probe.reason})"
    fused = [name for name, g in graphs.items() if g.kernels]
    return f"portable graph ({graph}/" + (f"; not {fused[0]}/: {probe.reason})" if fused and not probe.runs else ")")


def _refusal(folder: Path, meta: BundleMeta, probe: KernelProbe | None) -> str:
    failed = next((f"probe: {name}: {outcome}" for name, outcome in (probe.kernels if probe else {}).items()
                   if outcome != "ok"), probe.reason if probe else "no graph")
    return (f"{Path(folder) / BUNDLE_FILE}: format {meta.format} bundle has only the fused server graph, "
            f"which this CPU cannot run ({failed}); re-export it with kedro run --pipelines export")


def speed_figures(folder: Path, forms: list[str]) -> tuple[dict[str, float], str]:
    """The export's figures of ``forms`` that can be compared (lower is faster) and their unit: milliseconds
    per generated token when every form has one, else the forward pass's p50 at the smallest batch; none
    when ``latency.json`` is missing or unreadable."""
    try:
        latency = LatencyReport.read(folder)
        generation = (latency.generation or {}).get("forms", {})
        if forms and all(name in generation for name in forms):
            return {name: float(generation[name]["ms_per_token"]) for name in forms}, "ms/token"
        rows = {name: latency.forms[name] for name in forms if name in latency.forms}
        if len(rows) == len(forms) and forms:
            batch = min(next(iter(rows.values())), key=lambda b: int(b.removeprefix("batch_")))
            return {name: float(row[batch]["p50"]) for name, row in rows.items()}, f"ms p50 at {batch}"
    except (ValueError, KeyError, TypeError, AttributeError):  # DescriptionError is a ValueError
        pass
    return {}, ""


def server_prefix(folder: Path, choice: Choice) -> Path:
    """The prefill graph's prefix of the chosen Paddle Inference graph."""
    return Path(folder) / str(choice.graph) / SERVER_MODEL
