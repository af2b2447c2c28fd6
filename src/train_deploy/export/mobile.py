"""The int8 graphs in ONNX Runtime's mobile format (``.ort``) for Android and iOS, and the proof they answer alike.

Paddle Lite is Paddle's own mobile runtime, but its last wheel (2.12, 2022) has no build for Python 3.11, so the
bundle cannot make or check a Paddle Lite model (``docs/export.md``). ONNX Runtime Mobile runs the ``.ort`` format
(a FlatBuffers file that loads without protobuf) with the same kernels as the ``onnxruntime`` package, so the file
is converted and checked here, on the exporting machine, by the package that serves the ONNX graphs.

:func:`convert_to_ort` converts ``edge/model.int8.onnx`` and ``edge/decode.int8.onnx`` with ONNX Runtime's own tool
(``onnxruntime.tools.convert_onnx_models_to_ort``: optimisations fixed at conversion, for ARM) and writes
``edge/required_operators.config``, the operator list a reduced ONNX Runtime build takes
(``build.sh --minimal_build --include_ops_by_config``). :func:`mobile_report` loads the ``.ort`` files with the
``onnxruntime`` package and generates greedily from validation prompts with them and with the int8 ONNX graphs: the
tokens must be identical (:class:`~train_deploy.export.checks.ParityError` otherwise).
"""

from __future__ import annotations

import contextlib
import io
import logging
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from train_deploy.export.backends import OnnxRuntimeBackend
from train_deploy.export.edge import INT8_FILE, external_data
from train_deploy.export.graph import DECODE_MODEL

logger = logging.getLogger(__name__)

MOBILE_FILE = "model.int8.ort"
OPERATORS_FILE = "required_operators.config"
MOBILE_REPORT = "mobile.json"
TARGET_PLATFORM = "arm"  # phones: no x86-only layout optimisations baked into the file
_PROMPTS, _PROMPT_TOKENS, _NEW_TOKENS = 4, 8, 16


def convert_to_ort(edge: Path) -> list[Path]:
    """Write ``edge``'s int8 graphs (``model`` and ``decode``; not the server's in-place decode graph) as
    ``*.int8.ort`` beside them, and :data:`OPERATORS_FILE`; return the written files. The converter's absolute
    paths are kept out of the operator file (it names the models by file name), so equal graphs give equal files
    wherever they were exported."""
    from onnxruntime.tools.convert_onnx_models_to_ort import OptimizationStyle, convert_onnx_models_to_ort

    names = (INT8_FILE, INT8_FILE.replace("model", DECODE_MODEL, 1))
    sources = sorted(edge / name for name in names if (edge / name).is_file())
    with tempfile.TemporaryDirectory(prefix="train_deploy-ort-") as staging:
        given, made = Path(staging) / "onnx", Path(staging) / "ort"
        given.mkdir()
        for source in sources:
            for part in (source, external_data(source)):
                if part.exists():
                    shutil.copy2(part, given / part.name)
        said = io.StringIO()
        tool_log = logging.getLogger("ort_format_model.utils")  # its own handler, naming the staging folder
        level = tool_log.level
        tool_log.setLevel(logging.WARNING)
        try:
            with contextlib.redirect_stdout(said):  # the tool reports with print()
                convert_onnx_models_to_ort(given, made, optimization_styles=[OptimizationStyle.Fixed],
                                           target_platform=TARGET_PLATFORM)
        finally:
            tool_log.setLevel(level)
        logger.debug("ONNX Runtime mobile conversion: %s", said.getvalue().strip())
        written = []
        for source in sources:
            target = edge / source.with_suffix(".ort").name
            shutil.move(made / target.name, target)
            written.append(target)
        operators = (made / OPERATORS_FILE).read_text(encoding="utf-8").splitlines()
    header = ["# Operators of the ONNX Runtime mobile models (a reduced build's --include_ops_by_config):",
              *(f"# - {path.name}" for path in written)]
    (edge / OPERATORS_FILE).write_text("\n".join([*header, *(line for line in operators if not
                                                              line.startswith("#"))]) + "\n", encoding="utf-8")
    return [*written, edge / OPERATORS_FILE]


def greedy_ids(form: Any, prompts: list[list[int]], new_tokens: int, context: int, eos_id: int) -> list[list[int]]:
    """The tokens ``form`` (an ONNX Runtime backend) generates greedily after each prompt, with its KV cache."""
    from train_deploy.export.runtime import LanguageModel

    made: list[list[int]] = [[] for _ in prompts]
    model = LanguageModel(form, None, context=context, eos_id=eos_id)
    for row, token in model.stream_ids(prompts, new_tokens, lambda row, logits: int(np.argmax(logits))):
        made[row].append(token)
    return made


def mobile_report(edge: Path, windows: np.ndarray, threads: int, context: int, eos_id: int) -> dict[str, Any]:
    """The ``.ort`` model against ``edge``'s int8 ONNX model: greedy tokens from the first validation ``windows``
    (``passed`` when identical), the largest |logit| difference on them, and both files' sizes."""
    # the int8 graphs the .ort files were converted from: their growing cache, not the in-place decode graph
    mobile, int8 = (OnnxRuntimeBackend(edge / name, threads, in_place=False) for name in (MOBILE_FILE, INT8_FILE))
    rows = windows[:_PROMPTS, :min(_PROMPT_TOKENS, context - _NEW_TOKENS - 1)].astype(np.int64)
    prompts = [[eos_id, *row.tolist()] for row in rows]
    expected = greedy_ids(int8, prompts, _NEW_TOKENS, context, eos_id)
    found = greedy_ids(mobile, prompts, _NEW_TOKENS, context, eos_id)
    differing = [row for row, (a, b) in enumerate(zip(expected, found, strict=True)) if a != b]
    mask = np.ones_like(rows)
    diff = float(np.abs(mobile(rows, mask) - int8(rows, mask)).max())
    sizes = {path.name: path.stat().st_size for path in sorted(edge.glob("*.int8.*")) if path.suffix in
             (".ort", ".onnx") and path.stem.split(".")[0] in ("model", DECODE_MODEL)}
    failures = [f"{MOBILE_FILE}: greedy tokens differ from {INT8_FILE} for prompt {row}: {found[row]} against "
                f"{expected[row]}" for row in differing]
    return {"file": f"edge/{MOBILE_FILE}", "operators": f"edge/{OPERATORS_FILE}", "target_platform": TARGET_PLATFORM,
            "reference": f"edge/{INT8_FILE} (ONNX Runtime, the same kernels)", "prompts": len(prompts),
            "prompt_tokens": int(rows.shape[1]), "new_tokens": _NEW_TOKENS, "greedy_tokens": found,
            "max_abs_logit_diff": diff, "sizes": sizes, "failures": failures, "passed": not failures}
