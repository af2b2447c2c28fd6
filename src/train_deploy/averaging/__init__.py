"""Checkpoint averaging: select the last K (or listed, or best) checkpoints and average them tensor by
tensor, streaming, into a checkpoint of the training stage's unified format (no Kedro imports here)."""
