"""The engine and graph a host runs a bundle on: the graph the CPU can run, the fastest engine when none is pinned,
and a format 7 bundle on a CPU that cannot run its only graph refused in one line (bundle folders with their
description and figures; the graphs themselves are loaded in test_runtime.py and test_emulated.py)."""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
from pathlib import Path

import pytest

from train_deploy.environment import cpu_identity, this_cpu
from train_deploy.export import LanguageModel, host_speed, probe
from train_deploy.export.engines import bundle_graphs, choose_engine, graph_record
from train_deploy.handoffs import BundleMeta, DescriptionError

BOTH = {"server_portable": graph_record(False), "server": graph_record(True)}


# What bundle.json holds besides the graphs (BundleMeta's required keys), as a tiny export writes it.
DESCRIPTION = {"version": "v", "fingerprint": "f", "created_at": "", "source": {"checkpoint": "c", "step": 1},
               "model": {"architecture": "llama", "context": 8, "vocab_size": 8, "eos_id": 0, "hidden_size": 8,
                         "layers": 1, "heads": 1},
               "tokenizer": {}, "too_long": "raise", "server": {}, "edge": {}, "software": {}}


def bundle_folder(root: Path, graphs: dict | None, generation: dict[str, float] | None = None,
                  forward: dict[str, float] | None = None) -> tuple[Path, BundleMeta]:
    """A folder with ``bundle.json`` (format 8 with ``graphs``, 7 without), ``latency.json`` of the given
    figures (ms per token, forward p50 at batch 1) and an ONNX model file; and its description."""
    root.mkdir()
    meta = DESCRIPTION | {"format": 7 if graphs is None else 8} | ({} if graphs is None else {"graphs": graphs})
    (root / "bundle.json").write_text(json.dumps(meta), encoding="utf-8")
    latency = {"seq_length": 16, "repeats": 1, "unit": "ms",
               "forms": {name: {"batch_1": {"p50": ms, "p95": ms}, "batch_8": {"p50": 8 * ms, "p95": 8 * ms}}
                         for name, ms in (forward or {}).items()}}
    if generation:
        latency["generation"] = {"forms": {name: {"ms_per_token": ms} for name, ms in generation.items()}}
    (root / "latency.json").write_text(json.dumps(latency), encoding="utf-8")
    (root / "edge").mkdir()
    (root / "edge" / "model.onnx").write_bytes(b"onnx")
    return root, BundleMeta.read(root)


@pytest.fixture
def fused(monkeypatch, tmp_path):
    """``fused(True/False)``: this host runs the fused kernels or not (``TRAIN_DEPLOY_FUSED_KERNELS``)."""
    monkeypatch.setenv("TRAIN_DEPLOY_CACHE_DIR", str(tmp_path / "cache"))

    def set_to(runs: bool) -> None:
        monkeypatch.setenv("TRAIN_DEPLOY_FUSED_KERNELS", "on" if runs else "off")
        probe._verdict.cache_clear()

    yield set_to
    probe._verdict.cache_clear()


def test_paddle_takes_the_fused_graph_where_it_runs_else_the_portable_one(tmp_path, fused):
    folder, meta = bundle_folder(tmp_path / "b", BOTH)
    fused(True)
    choice = choose_engine(folder, meta, "paddle", "cpu")
    assert (choice.backend, choice.graph, choice.form) == ("paddle", "server", "paddle_inference")
    fused(False)
    choice = choose_engine(folder, meta, "paddle", "cpu")
    assert (choice.backend, choice.graph, choice.form) == ("paddle", "server_portable", "paddle_portable")
    assert choice.why == ("Paddle Inference, portable graph (server_portable/; not server/: "
                          "TRAIN_DEPLOY_FUSED_KERNELS=off) (asked for)")
    assert choose_engine(folder, meta, "paddle", "gpu").graph == "server"  # GPU kernels: no probe
    assert choose_engine(folder, meta, "onnx", "cpu").backend == "onnx"


def test_unpinned_the_fastest_engine_the_host_runs_is_chosen_by_the_exports_figures(tmp_path, fused):
    # the CPU: the portable Paddle graph 5x slower per token than ONNX Runtime, the fused one faster
    figures = {"paddle_inference": 4.0, "paddle_portable": 25.0, "onnx_fp32": 5.0}
    folder, meta = bundle_folder(tmp_path / "b", BOTH, generation=figures)
    fused(True)
    assert choose_engine(folder, meta, None, "cpu", measure=False).form == "paddle_inference"
    fused(False)
    choice = choose_engine(folder, meta, "auto", "cpu", measure=False)
    assert (choice.backend, choice.form, choice.graph) == ("onnx", "onnx_fp32", None)
    assert choice.why == ("ONNX Runtime fp32: the fastest this host runs at export's figures (paddle_portable 25 "
                          "ms/token, onnx_fp32 5 ms/token); not the fused graph: TRAIN_DEPLOY_FUSED_KERNELS=off")
    # where the fused kernels run but the portable graph is faster (two threads on this machine), it is taken
    folder, meta = bundle_folder(tmp_path / "e", BOTH, generation={"paddle_inference": 9.0, "paddle_portable": 5.0,
                                                                     "onnx_fp32": 6.0})
    fused(True)
    choice = choose_engine(folder, meta, None, "cpu", measure=False)
    assert (choice.form, choice.graph) == ("paddle_portable", "server_portable")
    assert choice.why.startswith("Paddle Inference, portable graph (server_portable/): the fastest this host runs")
    assert choose_engine(folder, meta, "paddle", "cpu").graph == "server"  # pinned: the fused graph where it runs
    fused(False)
    assert choose_engine(folder, meta, "auto", "gpu", measure=False).form == "paddle_inference"
    # without generation figures, the forward pass's p50 at the smallest batch
    folder, meta = bundle_folder(tmp_path / "c", BOTH, forward={"paddle_portable": 3.0, "onnx_fp32": 6.0})
    choice = choose_engine(folder, meta, None, "cpu", measure=False)
    assert choice.form == "paddle_portable" and "ms p50 at batch_1" in choice.why
    # without figures at all, Paddle Inference when it can run
    folder, meta = bundle_folder(tmp_path / "d", BOTH)
    assert choose_engine(folder, meta, None, "cpu", measure=False).form == "paddle_portable"


def test_a_format_7_bundle_on_a_cpu_that_cannot_run_it_is_refused_in_one_line_or_runs_on_onnx(tmp_path, fused):
    folder, meta = bundle_folder(tmp_path / "old", None, forward={"paddle_inference": 2.0, "onnx_fp32": 3.0})
    assert set(bundle_graphs(folder, meta)) == {"server"}
    fused(True)  # where the probe passes, format 7 loads as before
    assert choose_engine(folder, meta, "paddle", "cpu").graph == "server"
    assert choose_engine(folder, meta, None, "cpu", measure=False).form == "paddle_inference"
    fused(False)
    refused = choose_engine(folder, meta, "paddle", "cpu").refusal
    assert refused == (f"{folder}/bundle.json: format 7 bundle has only the fused server graph, which this CPU "
                       "cannot run (TRAIN_DEPLOY_FUSED_KERNELS=off); re-export it with kedro run --pipelines export")
    assert "\n" not in refused
    unpinned = choose_engine(folder, meta, None, "cpu", measure=False)
    assert unpinned.form == "onnx_fp32" and unpinned.refusal is None and "not the fused graph: TRAIN_DEPLOY_FUSED" \
        "_KERNELS=off" in unpinned.why


def test_graphs_of_bundle_json_are_read_typed_and_named(tmp_path):
    with pytest.raises(DescriptionError, match=r"bundle.json: graphs.server_portable.kernels: .*list"):
        bundle_folder(tmp_path / "b", {"server_portable": {"kernels": "swiglu", "needs": []}})
    folder, _ = bundle_folder(tmp_path / "c", {"server_tiny": {}})
    with pytest.raises(DescriptionError, match=r"bundle.json: graphs.server_tiny: unknown graph"):
        bundle_graphs(folder, BundleMeta.read(folder))


@pytest.fixture
def speed_cache(monkeypatch, tmp_path) -> Path:
    """An empty machine cache for the engine speed, with the session's kernel-probe verdict kept as a setting (so
    that no second probe runs); its ``engine_speed.json``."""
    runs = probe.fused_kernels("cpu").runs
    monkeypatch.setenv("TRAIN_DEPLOY_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("TRAIN_DEPLOY_FUSED_KERNELS", "on" if runs else "off")
    probe._verdict.cache_clear()
    yield tmp_path / "cache" / host_speed.CACHE_FILE
    probe._verdict.cache_clear()


def _described(figures: dict[str, float]) -> str:
    return ", ".join(f"{form} {ms:.3g} ms/token" for form, ms in figures.items())


def test_the_first_unpinned_load_times_each_engine_in_its_own_process_and_a_second_reads_the_cache(
        tiny_bundle, speed_cache, monkeypatch, caplog):
    def no_child(*args, **kwargs):
        raise AssertionError("a child process was started")  # a child costs seconds per bundle (host_speed.py)

    caplog.set_level(logging.INFO, logger="train_deploy.export")
    with monkeypatch.context() as patch:
        patch.setattr(subprocess, "Popen", no_child)
        model = LanguageModel.load(tiny_bundle)
    (entry,) = json.loads(speed_cache.read_text()).values()
    figures = entry["ms_per_token"]
    fused = probe.fused_kernels("cpu").runs
    assert list(figures) == [*(["paddle_inference"] if fused else []), "paddle_portable", "onnx_fp32"]
    assert all(ms > 0 for ms in figures.values())
    assert model.engine == min(figures, key=figures.get)
    cpu, flags = cpu_identity(this_cpu())
    assert (entry["cpu"], entry["flags_digest"], entry["wheels"][0]) == (cpu, flags, probe.paddle_version())
    assert entry["wheels"][1].startswith("onnxruntime==")
    described = f"{_described(figures)}; measured on this host now"
    assert f"Engine speed of {tiny_bundle} on this host ({cpu}): {described}" in caplog.messages
    chosen = f"the fastest this host runs by its own figures ({described})"
    assert any(line.startswith(f"Loaded {tiny_bundle}: ") and line.endswith(chosen) for line in caplog.messages)

    def measured_again(*args):
        raise AssertionError("measured again")

    monkeypatch.setattr(host_speed, "measure_forms", measured_again)
    caplog.clear()
    again = LanguageModel.load(tiny_bundle)
    assert again.engine == model.engine
    cached = f"{_described(figures)}; measured on this host at {entry['measured_at']}, cached"
    assert f"Engine speed of {tiny_bundle} from the cache: {cached}" in caplog.messages


def test_a_changed_bundle_is_timed_again_and_its_figures_decide(tiny_bundle, speed_cache, monkeypatch, tmp_path):
    timed: list[Path] = []

    def measure(folder: Path, meta: BundleMeta, candidates: dict[str, str | None]) -> dict[str, float]:
        timed.append(folder)
        return {form: 9.0 if form != "onnx_fp32" else 2.0 for form in candidates}  # ONNX Runtime the fastest here

    monkeypatch.setattr(host_speed, "measure_forms", measure)
    first = choose_engine(tiny_bundle, BundleMeta.read(tiny_bundle), None, "cpu")
    assert (first.form, timed) == ("onnx_fp32", [tiny_bundle])
    assert choose_engine(tiny_bundle, BundleMeta.read(tiny_bundle), "auto", "cpu").form == "onnx_fp32"
    assert timed == [tiny_bundle]  # the same bundle: from the cache
    changed = tmp_path / "changed"
    shutil.copytree(tiny_bundle, changed)
    description = json.loads((changed / "bundle.json").read_text())
    (changed / "bundle.json").write_text(json.dumps({**description, "created_at": "another export"}))
    choose_engine(changed, BundleMeta.read(changed), None, "cpu")
    assert timed == [tiny_bundle, changed]
    assert len(json.loads(speed_cache.read_text())) == 2


def test_a_failed_timing_leaves_the_choice_to_the_exports_figures_and_caches_nothing(tmp_path, speed_cache, caplog):
    folder, meta = bundle_folder(tmp_path / "b", BOTH, generation={"paddle_inference": 4.0, "paddle_portable": 3.0,
                                                                    "onnx_fp32": 5.0})
    caplog.set_level(logging.WARNING, logger="train_deploy.export.host_speed")
    choice = choose_engine(folder, meta, None, "cpu")  # it has no Paddle graphs and its model.onnx is not a model
    assert choice.form == "paddle_portable" and "at export's figures (" in choice.why
    (warning,) = [record.getMessage() for record in caplog.records if record.name == host_speed.__name__]
    form, graph = ("paddle_inference", "server") if probe.fused_kernels("cpu").runs else ("paddle_portable",
                                                                                          "server_portable")
    assert warning == (f"Engine speed not measured on this host: {form} failed (BundleError: {folder / graph}: no "
                       "Paddle Inference model (model.json, model.pdiparams)); the export's figures decide")
    assert not speed_cache.exists()
