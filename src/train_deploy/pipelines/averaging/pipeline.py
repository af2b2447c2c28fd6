"""Averaging: average the last checkpoints of training (around the lowest validation loss when it overfits),
evaluate against the last one, pick one."""

from kedro.pipeline import Node, Pipeline

from .nodes import average, evaluate


def create_pipeline(**kwargs) -> Pipeline:
    return Pipeline([
        Node(average, ["params:averaging", "training_result"], "averaged_checkpoint", name="average_checkpoints"),
        Node(evaluate, ["params:averaging", "averaged_checkpoint", "training_result", "token_files"],
             ["selected_checkpoint", "averaging_metrics", "averaging_plot"], name="evaluate_checkpoints"),
    ])
