"""The registered model the retention tests share and the bundle.json files they write."""

from __future__ import annotations

from train_deploy.handoffs import BundleMeta, BundleModel, BundleSource, to_json

MODEL = "retention_lm"


def bundle_meta(fingerprint: str) -> dict:
    """A ``bundle.json`` the typed reader (``BundleMeta.read``) takes, with this fingerprint."""
    model = BundleModel(architecture="llama", context=64, vocab_size=100, eos_id=2, hidden_size=64, layers=2, heads=4)
    return to_json(BundleMeta(format=9, version="v", fingerprint=fingerprint, created_at="2026-12-01T00:00:00Z",
                              source=BundleSource(checkpoint="run0", step=1), model=model, tokenizer={},
                              too_long="raise", server={}, edge={}, software={}))
