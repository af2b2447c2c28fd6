"""The ``validation`` parameter block: the bounds within which tonight's corpus may differ from the champion's."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from train_deploy.config import block, from_mapping

Mode = Literal["stop", "warn"]
Screening = Literal["report", "drop"]


@block
class ValidationConfig:
    """Bounds on tonight's corpus statistics against the champion's (``train_deploy.validation.statistics``).
    A bound set to null is not checked. Nothing is compared while the model has no champion, or its champion
    records no statistics (registered before the data gate)."""

    mode: Mode = "stop"
    """stop: a corpus past a bound stops the run before training; warn: it is reported and training goes on."""
    max_documents_decrease: float | None = Field(0.3, ge=0, le=1)
    """Largest relative decrease of the documents kept (0.3: tonight keeps at least 70% of the champion's)."""
    max_documents_increase: float | None = Field(4.0, ge=0)
    """Largest relative increase of the documents kept (4.0: at most five times the champion's)."""
    max_characters_decrease: float | None = Field(0.3, ge=0, le=1)
    """Largest relative decrease of the characters kept."""
    max_characters_increase: float | None = Field(4.0, ge=0)
    """Largest relative increase of the characters kept."""
    max_cjk_share_change: float | None = Field(0.1, ge=0, le=1)
    """Largest absolute change of the share of CJK ideographs among the characters kept (another language, a
    wrong decoding)."""
    max_duplicate_share: float | None = Field(0.3, ge=0, le=1)
    """Largest share of the documents read that are exact or near duplicates (tonight's, not a change)."""
    max_byte_fallback_rate: float | None = Field(0.25, ge=0, le=1)
    """Largest share of tokens that are byte-fallback pieces (characters the tokenizer has no piece for). Measured:
    a tokenizer trained at character_coverage 0.98 (the tests' tiny one) leaves 5-13% on later People's Daily text;
    GBK read as latin-1, or English, 83-89%."""
    max_tokens_per_character_change: float | None = Field(0.25, ge=0)
    """Largest relative change of tokens per character (0.25: within ±25% of the champion's)."""
    max_length_quantile_factor: float | None = Field(2.0, ge=1)
    """Each length quantile (10%, 50%, 90% of characters per kept document) within this factor of the
    champion's, either way."""
    max_drop_share_increase: float | None = Field(0.2, ge=0, le=1)
    """Largest absolute increase of the share of documents read that any one drop reason takes (a filter's, or
    duplicate, near_duplicate)."""

    max_nats_per_char_increase: float | None = Field(0.15, ge=0)
    """Largest relative increase of the champion's loss on a seeded sample of tonight's kept documents (nats per
    character) over its loss on its own corpus, recorded on its version (0.15: at most 15% more). Calibrated on
    People's Daily (``benchmarks/calibrate_data_gate.py``, docs/benchmarks.md): good 1 MB nights +2.4% to +5.7%;
    Traditional characters +133%, shuffled characters +26%, 30% URL/QQ spam +18%, 20% spam +8% to +13% (under it
    with a weak champion: ``max_flagged_share`` stops them there; the default run's champion: good 1 MB nights
    +5.8% to +9.2%, 20% spam +16.2% and +19.5%)."""
    max_character_distance: float | None = Field(0.1, ge=0, le=1)
    """Largest Jensen–Shannon distance (0: the same, 1: disjoint) between tonight's character distribution and the
    champion's top characters and ``other``, recorded on its version (another script or alphabet). Calibrated:
    good nights 0.049 to 0.080 (1 MB; up to 0.092 at 400 kB), Traditional 0.30, 30% spam 0.11 to 0.12."""
    max_document_nats_factor: float | None = Field(1.2, ge=1)
    """A sampled document whose nats per character under the champion exceed this factor times the champion's own
    figure is flagged; the report gives their share (null: no screening). With ``max_flagged_share``, 1.2
    separated 20% spam from good nights best for a weak champion (at 1.5, 0-3% of both were flagged)."""
    max_flagged_share: float | None = Field(None, ge=0, le=1)
    """Largest share of the sampled documents flagged by ``max_document_nats_factor`` (spam mixed into good text,
    which moves a weak champion's average loss too little); null: not checked. Off by default because it depends
    on the champion (``benchmarks/calibrate_data_gate.py``, docs/benchmarks.md): a weak champion (600 steps of
    ``tiny``) flagged 0.09-0.20 of good nights and 0.27-0.37 of 20% spam nights (0.24 separates them), the default
    run's champion 0.25-0.34 of good 1 MB nights (0.24 would stop them all) and 0.42-0.43 of 20% spam, which its
    average loss already stops (``max_nats_per_char_increase``)."""

    screening: Screening = "report"
    """report: the screening's flagged share is reported (and bounded by ``max_flagged_share``); drop: once the gate
    lets the night through, every training document is scored by the champion (its first 100 characters, as the
    sample) and those above ``max_document_nats_factor`` times the champion's own figure are left out of the token
    files training reads (``train_deploy.validation.screening``; the validation split is kept whole). Nothing is
    dropped without a champion that records its own figure, or with ``max_document_nats_factor`` null; a drop that
    would leave the training split shorter than one window of ``training.batch.seq_length`` is refused."""

    @classmethod
    def from_params(cls, params: dict[str, Any] | None) -> ValidationConfig:
        return from_mapping(cls, params, "validation")
