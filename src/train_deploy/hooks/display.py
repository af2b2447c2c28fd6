"""What a run shows: the console and log file (opened by :class:`train_deploy.hooks.life.RunLife`), and what it made,
printed when it ends (:class:`ShowResults`)."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from kedro.framework.hooks import hook_impl

from train_deploy.console import log_above_bars_on_terminal, log_to_file, plain_console_unless_terminal
from train_deploy.handoffs import CurveDiagnosis, to_json
from train_deploy.training.diagnosis import beat_advice

logger = logging.getLogger(__name__)


def open_console(project_path: str | Path) -> None:
    """Every record of the run in the project's ``logs/train_deploy.log``, plain console lines when the console is
    not a terminal, and records above the progress bars when it is one (``train_deploy.console``)."""
    log_to_file(project_path)
    plain_console_unless_terminal()
    log_above_bars_on_terminal()


class ShowResults:
    """What a run made, printed when it ends: the bundle, then the registry's decision (last of a run). Independent
    of every other hook: it reads the catalog only."""

    @hook_impl
    def after_pipeline_run(self, run_params, pipeline, catalog) -> None:
        outputs = pipeline.all_outputs()
        if "export_bundle" in outputs:
            show_bundle(catalog)
        if "registry_decision" in outputs:
            show_registry_decision(run_params, catalog)


def show_bundle(catalog) -> None:
    """Print where the exported bundle is, its validation loss beside the n-gram baselines and how to load it, with
    a sample that continues the start of a validation document (plain text, unwrapped)."""
    bundle = catalog.load("export_bundle")
    diagnosis = bundle.meta.source.diagnosis
    folder, baselines = bundle.path, _baseline_line(to_json(bundle.meta.source), bundle.parity.record(),
                                                    beat_advice(diagnosis))
    prompt, sample = _validation_sample(folder, catalog.load("token_files"))
    call = (f"model.generate({prompt!r}, max_new_tokens={SAMPLE_TOKENS}, temperature={SAMPLE_TEMPERATURE}, "
            f"top_k={SAMPLE_TOP_K}, seed=0)")
    sys.stdout.write(
        f"\nExported bundle: {folder}\n"
        f"  model card: {folder}/MODEL_CARD.md\n"
        + (f"  {baselines}\n" if baselines else "")
        + (f"  {_diagnosis_line(diagnosis)}\n" if diagnosis else "")
        + "  load it (the fastest engine here; backend='paddle' or 'onnx', int8=True for the edge model):\n"
        "    from train_deploy.export import LanguageModel\n"
        f"    model = LanguageModel.load({folder!r})\n"
        f"    print({call})\n"
        + (f"  which printed: {prompt}|{sample}\n" if sample is not None else ""))


SAMPLE_TOKENS, SAMPLE_TEMPERATURE, SAMPLE_TOP_K = 30, 0.8, 20
"""The end-of-run sample: a little sampling (greedy decoding of a small model repeats itself), a fixed seed."""
PROMPT_TOKENS = 8
"""The prompt: at most this many tokens of the first validation document (at most half of it)."""


def _baseline_line(source: dict, parity: dict, advice: str | None = None) -> str | None:
    """The model's validation loss beside the n-gram baselines of the same windows: the evaluation windows the
    loss was measured on, else the parity windows (None for bundles made before the baselines); ``advice``: what
    the training curves say could beat them."""
    from train_deploy.baselines import Baselines

    if source.get("val_baselines") and source.get("val_loss") is not None:
        base, loss = source["val_baselines"], source["val_loss"]
    elif parity.get("baselines"):
        base, loss = parity["baselines"], parity["baselines"]["model_loss"]
    else:
        return None
    return "validation: " + Baselines.from_report(base).describe(loss, advice)


def _diagnosis_line(diagnosis: CurveDiagnosis) -> str:
    """What the training curves said, and what could do better."""
    return f"training curves: {diagnosis.summary}" + (f"; what could do better: {diagnosis.advice}"
                                                      if diagnosis.advice else "")


def _validation_sample(folder: str, tokens) -> tuple[str, str | None]:
    """The start of the first validation document, decoded, and the bundle's sampled continuation of it (None,
    with a warning, when the bundle cannot generate here)."""
    import numpy as np

    from train_deploy.export import LanguageModel

    try:
        valid = np.memmap(f"{tokens.prefix('valid')}.bin", dtype=np.dtype(tokens.dtype), mode="r")
        ends = np.flatnonzero(np.asarray(valid[:4096]) == tokens.tokenizer.eos_id)
        document = np.asarray(valid[: ends[0] if len(ends) else min(len(valid), 4096)], dtype=np.int64)
        model = LanguageModel.load(folder)
        prompt = model.tokenizer.decode(document[: max(1, min(PROMPT_TOKENS, len(document) // 2))].tolist())
        prompt = prompt if prompt.strip() else "中国"
        return prompt, model.generate(prompt, max_new_tokens=SAMPLE_TOKENS, temperature=SAMPLE_TEMPERATURE,
                                      top_k=SAMPLE_TOP_K, seed=0)
    except Exception as exc:  # a hint must not fail a run that has finished
        logger.warning("No sample from %s: %s", folder, exc)
        return "中国", None


def show_registry_decision(run_params: dict, catalog) -> None:
    """Print the registering run's MLflow run, the version and whether it became ``champion``, the gate's decision
    with the comparison's interval and the set's size, the baseline rule's figures and the reason (plain text,
    unwrapped)."""
    from train_deploy.registry.cli import registry_command  # the commands as they work from any folder
    from train_deploy.serve import serve_line

    decision, project = catalog.load("registry_decision"), run_params["project_path"]
    verdict = ("became champion" if decision.champion else
               f"did not become champion (champion stays version {decision.previous_champion})")
    sys.stdout.write(
        f"\nMLflow run: {decision.run_id}\n"
        f"Registered {decision.model_name} version {decision.version}: {verdict} [{decision.decision}]\n"
        f"  {_comparison_line(decision)}\n"
        + (f"  {_baseline_rule_line(decision)}\n" if decision.val_loss is not None else "")
        + f"  reason: {decision.reason}\n"
        f"  serve the champion: {serve_line(decision.model_name, project)}\n"
        f"  history: {registry_command('history', decision.model_name, project, run_params.get('env'))}\n"
        f"  roll back: {registry_command('rollback', decision.model_name, project, run_params.get('env'))}\n")


def _comparison_line(decision) -> str:
    """The decision, the improvement and its interval, and the evaluation set's size."""
    if decision.interval is None:
        return f"gate: {decision.decision}, no comparison, on an evaluation set of {decision.eval_texts} texts"
    low, high = decision.interval
    return (f"gate: {decision.decision}, improvement {decision.improvement:.2%} over champion version "
            f"{decision.previous_champion} ({decision.confidence:.0%} interval {low:.2%} to {high:.2%}) on an "
            f"evaluation set of {decision.eval_texts} texts")


def _baseline_rule_line(decision) -> str:
    """The candidate's validation loss beside the baseline the gate held it to."""
    if decision.baseline_loss is None:
        return f"validation loss {decision.val_loss:.4f} nats/token; no {decision.baseline} baseline to compare"
    below = "below" if decision.val_loss < decision.baseline_loss else "NOT below"
    return (f"validation loss {decision.val_loss:.4f} nats/token, {below} the {decision.baseline} baseline's "
            f"{decision.baseline_loss:.4f} on the same windows")
