"""The MLflow model registry: the export bundle as an MLflow model, registered and promoted."""
