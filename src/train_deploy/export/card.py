"""MODEL_CARD.md of a bundle, generated from what the run recorded (nothing in it is written by hand).

The pictures (``plots/``, see ``train_deploy.export.plots``) are embedded with links relative to the card,
so they show wherever the bundle folder goes: a local copy, the MLflow run's ``export/bundle``.
"""

from __future__ import annotations

from typing import Any

from train_deploy.baselines import Baselines
from train_deploy.export.engines import FORM_FILES
from train_deploy.handoffs import BundleMeta, BundleSource, CheckpointState, LatencyReport, ParityReport


def model_card(meta: BundleMeta, state: CheckpointState, parity: ParityReport, latency: LatencyReport) -> str:
    model, source, training = meta.model, meta.source, state.training or {}
    batch, optimizer, schedule = (training.get(k, {}) for k in ("batch", "optimizer", "schedule"))
    corpus = source.corpus
    files = meta.sizes()
    lines = [
        f"# Model card: train_deploy causal LM, bundle {meta.version}",
        *_baseline_warning(source, parity),
        "",
        "## Model",
        f"- Llama-architecture decoder, {_count(model.parameters)} parameters: {model.layers} layers, "
        f"hidden size {model.hidden_size}, {model.heads} attention heads ({model.kv_heads} key/value), "
        f"context {model.context} tokens, vocabulary {model.vocab_size}.",
        f"- Source checkpoint: `{source.checkpoint}` (step {source.step}"
        + (f", average of checkpoints ({source.averaged})" if source.averaged else "") + ").",
        f"- Selected because: {source.selection}." if source.selection else None,
        "",
        "## Data",
        f"- Corpus fingerprint `{corpus.get('fingerprint', '?')}`, reader `{corpus.get('reader', '?')}`: "
        f"{corpus.get('train_documents', '?')} training documents ({corpus.get('train_tokens', '?')} tokens), "
        f"{corpus.get('valid_documents', '?')} validation documents ({corpus.get('valid_tokens', '?')} tokens).",
        f"- Tokenizer: {meta.tokenizer['encoder']} ({meta.tokenizer['vocab_size']} ids, hash "
        f"`{meta.tokenizer['hash']}`), in `tokenizer/`.",
        "",
        "## Training",
        f"- Preset `{training.get('model', {}).get('preset', '?')}`, sequence length {batch.get('seq_length', '?')}, "
        f"global batch {batch.get('global_batch_size', '?')}, {schedule.get('max_steps', '?')} steps, AdamW at "
        f"learning rate {optimizer.get('learning_rate', '?')} "
        f"(reference batch {optimizer.get('reference_batch_size', '?')}).",
        f"- Parallel layout of the run: {state.layout}." if state.layout else None,  # none when averaged
        f"- Validation loss {_num(source.val_loss)} nats/token on the "
        + (f"{source.val_baselines['windows']} " if source.val_baselines else "")
        + "evaluation windows of the validation split.",
        f"- Perplexity {_num(parity.perplexity.get('trained'))} on the {parity.samples} parity windows of "
        f"{parity.seq_length} tokens (another set: the windows the export compares its forms on).",
        *_baseline_lines(source, parity),
        *_diagnosis_lines(source),
        *_training_curves_section(meta),
        "",
        "## Exported forms and parity",
        "Reference: the trained model in Paddle eager mode, on the first validation windows.",
        "",
        "| form | file | size | max abs logit diff | perplexity |",
        "|---|---|---:|---:|---:|",
    ]
    for name, diff in parity.max_abs_logit_diff.items():
        path = FORM_FILES.get(name, "")
        lines.append(f"| {name} | `{path}` | {_size(files.get(path, 0))} | {diff:.2e} | "
                     f"{parity.perplexity[name]:.4g} |")
    for name, increase in (parity.fp16_perplexity_increase or {}).items():
        lines += ["", f"{name} ({parity.precision[name]}) perplexity vs the trained model: {increase:+.2%} "
                  f"(limit {parity.limits['max_fp16_perplexity_increase']:+.1%})."]
    if parity.int8_perplexity_increase is not None:
        lines += ["", f"int8 perplexity vs ONNX fp32: {parity.int8_perplexity_increase:+.2%} "
                  f"(limit {parity.limits['max_int8_perplexity_increase']:+.0%})."]
    lines += _cache_lines(parity)
    lines += _graph_lines(meta, parity)
    lines += _latency_section(latency, meta.plots)
    lines += [
        "",
        f"Measured on the exporting machine with {meta.server['cpu_threads']} threads "
        f"(Paddle {meta.software['paddlepaddle']}, ONNX Runtime {meta.software['onnxruntime']}).",
        "",
        "## Intended use and limits",
        "- Scoring (per-token log-probabilities, perplexity) and short continuations of Chinese text similar to the "
        "training corpus; a research and engineering baseline, not an assistant.",
        "- The model reproduces the style and the biases of its corpus and can state falsehoods fluently; do not use "
        "its output as fact or for decisions about people without review.",
        f"- Inputs longer than {model.context} tokens are "
        + ("rejected" if meta.too_long == "raise" else "cut to their last tokens") + " (`too_long`).",
        "- Generation uses a KV cache (a prefill and a one-token decode graph; on ONNX Runtime the decode step "
        "writes the cache in place, `edge/decode_inplace*.onnx`): its cost grows linearly with the output length; "
        "`parity.json` (`kv_cache`) proves every decode step equals full recomputation.",
    ] + _load_lines() + _mobile_lines(files)
    return "\n".join(line for line in lines if line is not None)


def _load_lines() -> list[str]:
    return [
        "",
        "## Load it",
        "```python",
        "from train_deploy.export import LanguageModel",
        "model = LanguageModel.load(\"<this folder>\")                          # the fastest engine here",
        "paddle = LanguageModel.load(\"<this folder>\", backend=\"paddle\")     # Paddle Inference",
        "edge = LanguageModel.load(\"<this folder>\", backend=\"onnx\", int8=True)  # ONNX Runtime int8",
        "print(model.generate(\"中国\", max_new_tokens=20, temperature=0))",
        "```",
        "",
    ]


def _mobile_lines(files: dict[str, int]) -> list[str]:
    """The ONNX Runtime Mobile model: its size beside the int8 ONNX graph's, and how a phone app runs it (format 10
    on; ``mobile.py``)."""
    if "edge/model.int8.ort" not in files:
        return []
    return [
        "## On Android and iOS (ONNX Runtime Mobile)",
        f"`edge/model.int8.ort` ({_size(files['edge/model.int8.ort'])}; the int8 ONNX graph it is converted from: "
        f"{_size(files.get('edge/model.int8.onnx', 0))}) and `edge/decode.int8.ort` "
        f"({_size(files.get('edge/decode.int8.ort', 0))}) are the int8 graphs in ONNX Runtime's mobile format, "
        "optimised for ARM at export. The export loaded them with the `onnxruntime` package and generated greedily "
        "from validation prompts: the tokens equal the int8 ONNX graphs' (`mobile.json`).",
        "- Android: the `com.microsoft.onnxruntime:onnxruntime-android` package (Gradle); iOS: the "
        "`onnxruntime-objc` or `onnxruntime-c` pod. Create an `OrtSession` (`ORTSession` on iOS) from the `.ort` "
        "file, feed `input_ids` and `attention_mask` (int64, `[batch, seq]`); the first output is the logits, the "
        "rest each layer's key/value cache, fed to `decode.int8.ort` with the next token.",
        "- Tokenise on the device with the tokenizer in `tokenizer/` (the one the model was trained with); a "
        "prompt starts with the end-of-document id, as `LanguageModel` feeds it.",
        "- A smaller app binary: build ONNX Runtime with `--minimal_build --include_ops_by_config "
        "edge/required_operators.config` (the operators these two graphs use, `com.microsoft.MatMulNBits` "
        "among them).",
        "",
    ]


def _graph_lines(meta: BundleMeta, parity: ParityReport) -> list[str]:
    """The Paddle Inference graphs shipped, what each needs, and the one not shipped (bundles of format 8 on)."""
    graphs = meta.graphs
    if not graphs:
        return []
    lines = ["", "## Server graphs (Paddle Inference)", ""]
    for name, graph in graphs.items():
        if graph.kernels:
            lines.append(f"- `{name}/`: Paddle's fused kernels ({', '.join(graph.kernels)}); runs on GPU and on a "
                         "CPU where they run in a probe (`probe.py`; Paddle 3.3.1's CPU `fused_rms_norm` needs "
                         "AVX-512): needs " + ", ".join(f"`{need}`" for need in graph.needs) + ".")
        else:
            lines.append(f"- `{name}/`: portable operators only; runs on every CPU Paddle supports. The ONNX models "
                         "are converted from it.")
    for name, why in (parity.not_shipped or {}).items():
        lines.append(f"- `{name}/` not shipped: {why}.")
    lines.append("- `LanguageModel.load` and the served model take the fused graph where it runs, else the portable "
                 "one; unpinned, the fastest engine the host runs by the generation figures below.")
    return lines


def _cache_lines(parity: ParityReport) -> list[str]:
    """Generation with the KV cache against full recomputation (bundles of format 6 on)."""
    cache = parity.kv_cache
    if not cache:
        return []
    diffs = ", ".join(f"{name} {diff:.2e}" for name, diff in cache["max_abs_logit_diff"].items())
    return ["", f"KV cache: {len(cache['prompt_lengths'])} left-padded prompts of {min(cache['prompt_lengths'])}–"
                f"{max(cache['prompt_lengths'])} tokens, prefilled and then decoded {cache['decode_steps']} steps; "
                f"max abs logit diff against full recomputation at every step: {diffs} (int8 against its own full "
                "pass)."]


def _comparisons(source: BundleSource, parity: ParityReport) -> list[tuple[str, float, dict[str, Any]]]:
    """(which windows, the model's loss on them, their n-gram baselines): the evaluation windows the validation
    loss was measured on, then the parity windows; bundles made before the baselines have none."""
    found = []
    if source.val_baselines and source.val_loss is not None:
        base = source.val_baselines
        found.append((f"the {base['windows']} evaluation windows of {base['seq_length']} tokens", source.val_loss,
                      base))
    if parity.baselines:
        found.append((f"the {parity.samples} parity windows", parity.baselines["model_loss"], parity.baselines))
    return found


def _baseline_warning(source: BundleSource, parity: ParityReport) -> list[str]:
    """A plain warning at the top when the model does not beat the strongest n-gram baseline on the most windows
    compared."""
    comparisons = _comparisons(source, parity)
    if not comparisons or Baselines.from_report(comparisons[0][2]).beaten_by(comparisons[0][1]):
        return []
    where, loss, base = comparisons[0]
    name, best = Baselines.from_report(base).strongest()
    return ["", f"> **Warning: this model does not yet beat the {name} baseline ({loss:.4f} vs {best:.4f} "
                f"nats/token on {where} of the validation split).** Counting tokens in its training split predicts "
                f"that text better. {_what_does_better(source)}; until then do not rely on its scores or output."]


def _what_does_better(source: BundleSource) -> str:
    """What the training curves say could do better, else the general advice (no diagnosis, or none clear)."""
    diagnosis = source.diagnosis
    if diagnosis is None or diagnosis.kind == "unknown":
        return "More steps (`training.schedule.max_steps`), a longer run on more text or a GPU do better"
    return f"The training curves show the run {diagnosis.kind}: what could do better is {diagnosis.advice}"


def _diagnosis_lines(source: BundleSource) -> list[str]:
    """What the training run's loss curves said, and what could do better (bundles before it say nothing)."""
    diagnosis = source.diagnosis
    if diagnosis is None:
        return []
    advice = f" What could do better: {diagnosis.advice}." if diagnosis.advice else ""  # none when unknown
    return [f"- Training curves: {diagnosis.summary}.{advice}"]


def _baseline_lines(source: BundleSource, parity: ParityReport) -> list[str]:
    """The model's loss beside the n-gram baselines of the same windows, in nats/token."""
    lines = []
    for where, loss, base in _comparisons(source, parity):
        baselines = Baselines.from_report(base)
        name, _ = baselines.strongest()
        kneser_ney = "".join(f", {kind} {value:.4f}" for kind, value in baselines.losses().items()
                             if kind.startswith("Kneser-Ney"))
        lines.append(f"- Against n-gram baselines on {where} (nats/token, counted on the training split, add-k and "
                     f"interpolated Kneser-Ney with k and discounts chosen on its held-out tail): unigram "
                     f"{base['unigram_loss']:.4f} (k={base['unigram_k']:g}), add-k bigram {base['bigram_loss']:.4f} "
                     f"(k={base['bigram_k']:g}){kneser_ney}; the model's {loss:.4f} is "
                     f"{'below' if baselines.beaten_by(loss) else '**not below**'} the strongest ({name}).")
    return lines


def _training_curves_section(meta: BundleMeta) -> list[str]:
    """The training picture, or one line saying why there is none (bundles made before plots say nothing)."""
    plots, curves = meta.plots, meta.training_curves
    if not plots:
        return []
    if "training" in plots:
        return ["", f"![Training loss and validation loss, learning rate, tokens/s and gradient norm by step, "
                    f"steps {curves.get('first_step', '?')}-{curves.get('last_step', '?')}]({plots['training']})"]
    return ["", f"No training curves: {curves.get('missing', 'no training metrics')}."]


def _latency_section(latency: LatencyReport, plots: dict[str, str]) -> list[str]:
    lines = ["", f"## Latency (one forward pass, sequence {latency.seq_length}, ms, p50 / p95)", ""]
    if "latency" in plots:
        lines += [f"![Latency by form and batch]({plots['latency']})", ""]
    batches = list(next(iter(latency.forms.values())))
    lines.append("| form | " + " | ".join(b.replace("_", " ") for b in batches) + " |")
    lines.append("|---|" + "---:|" * len(batches))
    for name, rows in latency.forms.items():
        cells = (f"{rows[b]['p50']:.1f} / {rows[b]['p95']:.1f}" for b in batches)
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    generation = latency.generation
    if generation:
        lines += ["", f"Greedy generation, batch 1, {generation['prompt_tokens']}-token prompt, "
                      f"{generation['new_tokens']} new tokens (prefill included):", "",
                  "| form | ms per new token | tokens/s |", "|---|---:|---:|"]
        lines += [f"| {name} | {row['ms_per_token']:.2f} | {row['tokens_per_s']:.0f} |"
                  for name, row in generation["forms"].items()]
    return lines


def _count(n: int | None) -> str:
    if not n:
        return "?"
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.1f} M"


def _num(x: float | None) -> str:
    return "?" if x is None else f"{x:.4g}"


def _size(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n else "?"
