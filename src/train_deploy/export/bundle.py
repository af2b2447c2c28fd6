"""Build a deployable bundle from a checkpoint: server and edge models, tokenizer, proofs, model card.

A bundle is one folder (the catalog's versioned ``export_bundle``: ``<path>/<version>/bundle/``)::

    bundle.json      what it is: source checkpoint, model shape, tokenizer, runtime settings, the server graphs
                     (``graphs``: each one's fused kernels and what it needs, engines.py), and every other file's
                     size and xxh3-128 hash (``files``), which loading checks (integrity.py)
    server/          Paddle Inference, the fused graph (Paddle's fused CPU kernels): the prefill/full pass
                     (model.json + model.pdiparams) and the one-token decode step with the KV cache
                     (decode.json + decode.pdiparams), see graph.py
    server_portable/ Paddle Inference, the portable graph (the same files): runs on every CPU
    edge/            ONNX fp32 (model.onnx, decode.onnx) and int8 (model.int8.onnx, decode.int8.onnx), converted
                     from the portable graph; the int8 pair in ONNX Runtime Mobile's format (model.int8.ort,
                     decode.int8.ort) with required_operators.config for a reduced ONNX Runtime build (mobile.py);
                     the decode step that updates its cache in place, which the server runs on ONNX Runtime
                     (decode_inplace.onnx, decode_inplace.int8.onnx, inplace.py)
    tokenizer/       the PaddleNLP tokenizer folder the model was trained with
    pretrained/      PaddleNLP's save_pretrained layout (config.json, float32 model.safetensors, the tokenizer):
                     LlamaForCausalLM.from_pretrained(folder) loads it; training.init_from: champion starts here
    mobile.json      the .ort graphs against the int8 ONNX graphs: greedy tokens (must be identical), sizes
    parity.json      logits of every form against the trained model on fixed validation windows, and
                     (kv_cache) generation with the cache against full recomputation at every step
    latency.json     p50/p95 of one forward pass per form, and (``generation``) milliseconds per token of a
                     short greedy generation per form: what LanguageModel.load compares to pick the fastest
    plots/           training.png (curves of the run up to the exported step, when its metrics are known)
                     and latency.png (by form and batch)
    MODEL_CARD.md    generated from all of the above, embedding the plots

The catalog gives an empty staging folder and publishes it only when this module returned (parity passed).

Every graph the bundle ships is proven here (parity and latency), the fused one too: so the fused graph is
shipped only when this machine can run it (on GPU, or on a CPU where the kernel probe passes, ``probe.py``).
Exported on a CPU where a fused kernel crashes (no AVX-512), the bundle ships the portable graph alone, and
``parity.json`` (``not_shipped``) and the model card say why: a graph no one has checked would be served
unproven on the machines that can run it. Export where the fused kernels run (or on GPU) to ship both.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import logging
import shutil
from pathlib import Path
from typing import Any

from train_deploy.export.backends import OnnxRuntimeBackend, PaddleInferenceBackend
from train_deploy.export.card import model_card
from train_deploy.export.checks import (
    add_cache_parity,
    cache_parity_report,
    check_parity,
    generation_report,
    latency_report,
    parity_report,
)
from train_deploy.export.config import ExportConfig
from train_deploy.export.edge import INT8_FILE, ONNX_FILE, convert_to_onnx, quantize_int8
from train_deploy.export.engines import GRAPH_FORMS, graph_record
from train_deploy.export.graph import (
    DECODE_MODEL,
    FUSED_DIR,
    PORTABLE_DIR,
    SERVER_MODEL,
    eager_logits,
    load_inference_model,
    save_server_model,
)
from train_deploy.export.hardware import disable_tf32
from train_deploy.export.inplace import INPLACE_DECODE, save_inplace_decode
from train_deploy.export.integrity import bundle_file_records
from train_deploy.export.mobile import MOBILE_REPORT, convert_to_ort, mobile_report
from train_deploy.export.plots import TrainingCurves, write_plots
from train_deploy.export.pretrained import save_pretrained_folder
from train_deploy.export.probe import fused_kernels
from train_deploy.handoffs import (
    BUNDLE_FILE,
    CARD_FILE,
    LATENCY_FILE,
    PARITY_FILE,
    TOKENIZER_FILE,
    Bundle,
    BundleMeta,
    CheckpointState,
    FileRecord,
    LatencyReport,
    ParityReport,
    TokenizerInfo,
    TokenManifest,
    from_json,
    to_json,
    write_json,
)
from train_deploy.hashing import digest, file_record
from train_deploy.progress import ProgressLog
from train_deploy.training.checkpoint import (
    MODEL_FILE,
    STATE_FILE,
    CheckpointError,
    check_trained_on,
    checkpoint_state,
    verify_checkpoint,
)

logger = logging.getLogger(__name__)

PRETRAINED_DIR = "pretrained"

FORMAT = 11  # part of the reuse fingerprint; 2: the compact server graph, 3: plots, 4: n-gram baselines in parity.json,
# 5: pretrained/, 6: prefill and decode graphs with a KV cache, 7: a cache input and output per layer, Paddle's fused
# kernels in server/, 8: the portable graph in server_portable/ and bundle.json's graphs, 9: each file's size and
# xxh3-128 hash in bundle.json's files, checked on load (integrity.py; LanguageModel refuses bundles older than 7:
# re-export, and loads 7 and 8 with a warning that their contents are not verified), 10: the int8 graphs in ONNX
# Runtime's mobile format (edge/*.int8.ort, required_operators.config) and their greedy parity in mobile.json, 11: the
# in-place decode graphs for ONNX Runtime (edge/decode_inplace*.onnx; older bundles decode with the growing cache)


def export_bundle(checkpoint: Path, tokenizer: TokenizerInfo, tokens: TokenManifest, config: ExportConfig,
                  provenance: dict[str, Any], curves: TrainingCurves, folder: Path) -> Bundle:
    """Export ``checkpoint`` into the empty ``folder`` and prove it; return the bundle's description.

    ``curves`` (the training run's metrics up to the checkpoint's step, or why there are none) become
    ``plots/training.png``; without rows the card says why there is no training picture.

    Parity is measured on the first windows of the validation split of ``tokens``, which must be the corpus
    the checkpoint was trained on; when it fails, its report is kept beside ``folder`` and
    :class:`ParityError` is raised. A damaged checkpoint (model file or ``state.json`` not as written) or
    another corpus stops it first with :class:`CheckpointError`.
    """
    checkpoint, folder = Path(checkpoint), Path(folder)
    record = verify_checkpoint(checkpoint, [MODEL_FILE])
    check_trained_on(record, tokens.fingerprint, checkpoint)
    state = checkpoint_state(checkpoint)
    check_tokenizer(tokenizer, state, checkpoint)
    version = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H.%M.%S.%fZ")
    with ProgressLog(5, "export", logger, unit="part", every_s=0) as progress:  # a line after each part
        model = load_inference_model(checkpoint)
        probe = fused_kernels(config.server.device)
        graphs = {PORTABLE_DIR: graph_record(False)} | ({FUSED_DIR: graph_record(True)} if probe.runs else {})
        for name in graphs:
            save_server_model(model, folder / name, portable=name == PORTABLE_DIR)
        progress.advance()  # the server graphs
        _save_edge_models(model, folder / PORTABLE_DIR / SERVER_MODEL, folder / "edge", config)
        del model
        progress.advance()  # ONNX, int8, the in-place decode graphs, .ort
        _copy_tokenizer(tokenizer, folder / "tokenizer")
        save_pretrained_folder(checkpoint, tokenizer, folder / PRETRAINED_DIR)
        meta = _bundle_meta(state, checkpoint, tokenizer, config, bundle_fingerprint(checkpoint, tokenizer, config,
                                                                                     curves), version, provenance)
        meta["graphs"], meta["kernel_probe"] = graphs, {"runs": probe.runs, "reason": probe.reason}
        write_json(folder / BUNDLE_FILE, meta)
        progress.advance()  # tokenizer, pretrained/, bundle.json
        parity, latency = _prove(folder, checkpoint, state, meta, config, tokens)
        if not probe.runs:
            parity["not_shipped"] = {FUSED_DIR: f"the fused graph could not be checked on the exporting machine: "
                                                f"{probe.reason}"}
        write_json(folder / PARITY_FILE, parity)
        if not parity["passed"]:  # kept for inspection; the bundle itself is never published
            write_json(folder.parent / f"parity-failed-{version}.json", parity)
        check_parity(parity, f"the bundle of {checkpoint}")
        progress.advance()  # parity, latency, mobile
        write_json(folder / LATENCY_FILE, latency)
        # Titled by the step, not the bundle version: equal inputs draw equal bytes.
        meta["plots"] = write_plots(folder, curves, latency, title=f"training up to step {state.step}")
        meta["training_curves"] = curves.summary()
        _write_card_and_records(folder, meta, state)
        progress.advance()  # plots, card, file records
    logger.info("Exported %s", checkpoint)
    return Bundle.read_folder(folder)


def _write_card_and_records(folder: Path, meta: dict[str, Any], state: CheckpointState) -> None:
    """Write the model card, then ``bundle.json`` with every other file's size and xxh3-128 hash (the card's too),
    which loading checks (``integrity.py``)."""
    meta["files"] = bundle_file_records(folder)
    card = model_card(from_json(BundleMeta, to_json(meta), str(folder / BUNDLE_FILE)), state,
                      ParityReport.read(folder), LatencyReport.read(folder))
    (folder / CARD_FILE).write_text(card, encoding="utf-8")
    meta["files"] = dict(sorted({**meta["files"], CARD_FILE: FileRecord(**file_record(folder / CARD_FILE))}.items()))
    write_json(folder / BUNDLE_FILE, meta)


def _save_edge_models(model: Any, prefix: Path, edge: Path, config: ExportConfig) -> None:
    """The ONNX models (fp32, and int8 when configured) of the portable graphs saved at ``prefix`` (``graph.py``),
    and ``model``'s in-place decode graph for ONNX Runtime (``inplace.py``)."""
    edge.mkdir()
    inplace = save_inplace_decode(model, edge / ONNX_FILE.replace("model", INPLACE_DECODE, 1))
    for graph in (prefix, prefix.with_name(DECODE_MODEL)):
        onnx_file = convert_to_onnx(graph, edge / ONNX_FILE.replace("model", graph.name, 1), config.edge.opset,
                                    config.edge.convert_timeout)
        if config.edge.int8:
            quantize_int8(onnx_file, edge / INT8_FILE.replace("model", graph.name, 1), config.edge.per_channel)
    if config.edge.int8:
        quantize_int8(inplace, edge / INT8_FILE.replace("model", INPLACE_DECODE, 1), config.edge.per_channel)
    if config.edge.int8:
        convert_to_ort(edge)  # ONNX Runtime Mobile's format of the int8 graphs (mobile.py)


def check_tokenizer(tokenizer: TokenizerInfo, state: CheckpointState, checkpoint: Path) -> None:
    """The tokenizer must be the one the checkpoint was trained with (same ids, same vocabulary)."""
    trained = state.data or {}
    model_vocab = (state.model_config or {})["vocab_size"]
    if tokenizer.vocab_size > model_vocab or tokenizer.vocab_size != trained.get("vocab_size", tokenizer.vocab_size):
        raise CheckpointError(f"{tokenizer.path}: the tokenizer has {tokenizer.vocab_size} ids but {checkpoint} was "
                              f"trained with {trained.get('vocab_size', model_vocab)}; export with the training "
                              "tokenizer")
    if trained.get("tokenizer_hash") and trained["tokenizer_hash"] != tokenizer.hash:
        raise CheckpointError(f"{tokenizer.path}: tokenizer {tokenizer.hash} is not the one {checkpoint} was trained "
                              f"with ({trained['tokenizer_hash']}); export with the training tokenizer")


def _prove(folder: Path, checkpoint: Path, state: CheckpointState, meta: dict[str, Any], config: ExportConfig,
           tokens: TokenManifest) -> tuple[dict[str, Any], dict[str, Any]]:
    """Parity and latency of every form (each server graph the bundle ships, ONNX), the trained model (Paddle
    eager) as reference; latency with each form's generation speed."""
    import paddle

    from train_deploy.baselines import baselines_for
    from train_deploy.training.evaluation import load_model, validation_windows

    paddle.base.core.set_num_threads(config.server.cpu_threads)  # the eager reference gets the same threads
    disable_tf32()  # the reference is float32 on a GPU wheel's default device too
    trained = load_model(checkpoint)
    forms: dict[str, Any] = {GRAPH_FORMS[name]: PaddleInferenceBackend(folder / name / SERVER_MODEL, config.server,
                                                                        meta["model"]["context"])
                             for name in sorted(meta["graphs"])}  # server (fused) before server_portable
    forms["onnx_fp32"] = OnnxRuntimeBackend(folder / "edge" / ONNX_FILE, config.edge.threads)
    if config.edge.int8:
        forms["onnx_int8"] = OnnxRuntimeBackend(folder / "edge" / INT8_FILE, config.edge.threads)
    context, vocab = meta["model"]["context"], meta["model"]["vocab_size"]
    seq = min(config.parity.seq_length or (state.training or {})["batch"]["seq_length"], context)
    windows = validation_windows(tokens.prefix("valid"), tokens.dtype, seq, config.parity.samples)
    precisions = {GRAPH_FORMS[name]: config.server.form_precision for name in meta["graphs"]}
    parity = parity_report(windows, lambda ids, mask: eager_logits(trained, ids), forms, vocab, config.parity,
                           precisions=precisions, baselines=baselines_for(tokens, windows))
    parity = add_cache_parity(parity, cache_parity_report(
        windows, lambda ids, mask: eager_logits(trained, ids), forms, config.parity, precisions=precisions))
    latency = latency_report({"paddle_eager": lambda ids, mask: eager_logits(trained, ids), **forms}, vocab,
                             context, config.latency)
    generation = generation_report(forms, vocab, context, meta["model"]["eos_id"], config.latency)
    if config.edge.int8:  # the .ort graphs must generate what the int8 ONNX graphs generate (mobile.py)
        mobile = mobile_report(folder / "edge", windows, config.edge.threads, context, meta["model"]["eos_id"])
        write_json(folder / MOBILE_REPORT, mobile)
        failures = parity["failures"] + mobile["failures"]
        parity = {**parity, "failures": failures, "passed": not failures}
    return parity, latency | ({"generation": generation} if generation else {})


def _bundle_meta(state: CheckpointState, checkpoint: Path, tokenizer: TokenizerInfo, config: ExportConfig,
                 fingerprint: str, version: str, provenance: dict[str, Any]) -> dict[str, Any]:
    import onnxruntime
    import paddle
    import paddle2onnx

    model = state.model_config or {}
    return {
        "format": FORMAT, "version": version, "fingerprint": fingerprint,
        "created_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        # An averaged checkpoint's state carries its newest source's validation loss: only the evaluation
        # node's number (in ``provenance``) describes the averaged weights.
        "source": {"checkpoint": str(checkpoint), "step": state.step,
                   "val_loss": None if state.averaged is not None else state.val_loss,
                   "averaged": state.averaged.method if state.averaged is not None else None, **provenance},
        "model": {"architecture": "llama", "parameters": state.parameters, "context":
                  model["max_position_embeddings"], "vocab_size": model["vocab_size"], "eos_id": tokenizer.eos_id,
                  "hidden_size": model["hidden_size"], "layers": model["num_hidden_layers"],
                  "heads": model["num_attention_heads"], "kv_heads": model.get("num_key_value_heads")},
        "tokenizer": {**to_json(tokenizer), "path": "tokenizer"},
        "too_long": config.too_long, "server": dataclasses.asdict(config.server),
        "edge": dataclasses.asdict(config.edge),
        "software": {"paddlepaddle": paddle.__version__, "paddle2onnx": paddle2onnx.__version__,
                     "onnxruntime": onnxruntime.__version__},
    }


def _copy_tokenizer(tokenizer: TokenizerInfo, target: Path) -> None:
    shutil.copytree(tokenizer.path, target)
    write_json(target / TOKENIZER_FILE, tokenizer)


def bundle_fingerprint(checkpoint: Path, tokenizer: TokenizerInfo, config: ExportConfig,
                       curves: TrainingCurves) -> str:
    """Equal for the same checkpoint files, tokenizer, export configuration and training curves: the bundle
    would be the same. The latency picture is drawn from the bundle's own measurements, so it needs no entry;
    the training picture depends on metrics outside the checkpoint, so their digest is in."""
    weights = Path(checkpoint) / MODEL_FILE
    if not weights.is_file():
        raise CheckpointError(f"{weights}: missing")
    stat = weights.stat()
    payload = {"checkpoint": str(Path(checkpoint).resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns,
               "state": (Path(checkpoint) / STATE_FILE).read_text(encoding="utf-8"), "tokenizer": tokenizer.hash,
               "config": {k: v for k, v in config.to_dict().items() if k != "reuse"}, "format": FORMAT,
               "training_curves": curves.digest,
               "fused_graph": fused_kernels(config.server.device).runs}  # a bundle without it is another bundle
    return digest(payload)
