"""The language-model server: one ASGI app (``app.py``) for ``train-deploy serve``, the serving check before promotion
and the tests: MLflow's ``/invocations``, OpenAI's ``/v1/completions`` and ``/v1/models``, with admission control
(``admission.py``) and requests read within limits (``requests.py``). See docs/serving.md."""
