"""Export: Paddle Inference for servers, ONNX (fp32 and int8) for the edge, and the runtime that loads both."""

from train_deploy.export.runtime import LanguageModel, TextScore

__all__ = ["LanguageModel", "TextScore"]
