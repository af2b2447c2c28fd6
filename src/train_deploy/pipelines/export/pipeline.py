"""Export: the selected checkpoint into a bundle for servers and edge devices, with parity, latency and plots."""

from kedro.pipeline import Node, Pipeline

from .nodes import export_model, report_export


def create_pipeline(**kwargs) -> Pipeline:
    return Pipeline([
        Node(export_model, ["params:export", "selected_checkpoint", "tokenizer", "token_files", "training_result",
                            "training_logs"], ["export_bundle", "training_curves"], name="export_bundle"),
        Node(report_export, "export_bundle", "export_metrics", name="report_export"),
    ])
