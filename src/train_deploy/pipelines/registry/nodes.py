"""Node of the registry stage: register the bundle, gate it against the champion, move the aliases last."""

from __future__ import annotations

import json
import logging
from functools import partial
from pathlib import Path
from typing import Any

from train_deploy.handoffs import Bundle, TokenizerInfo, TokenManifest, TrainingResult
from train_deploy.registry.config import RegistryConfig
from train_deploy.registry.evalset import jsonl_texts, validation_texts
from train_deploy.registry.gate import RegistryDecision, git_commit, promotion_event, register_and_gate, version_tags

logger = logging.getLogger(__name__)


def register_bundle(registry: dict[str, Any], export_bundle: Bundle, token_files: TokenManifest,
                    tokenizer: TokenizerInfo, training_result: TrainingResult) -> tuple[RegistryDecision, str]:
    """Return the gate's decision on the new version and its history line (JSONL) for the run."""
    config = RegistryConfig.from_params(registry)
    texts = config.eval_set
    build_texts = (partial(jsonl_texts, texts.path, texts.documents, texts.max_chars) if texts.path else
                   partial(validation_texts, token_files, tokenizer, texts.documents, texts.max_chars))
    tags = version_tags(export_bundle, token_files, training_result, git_commit(Path.cwd()))  # the project
    decision = register_and_gate(export_bundle, config, tags, build_texts)
    return decision, json.dumps(promotion_event(decision), ensure_ascii=False) + "\n"
