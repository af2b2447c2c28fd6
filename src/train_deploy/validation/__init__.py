"""The data gate before training (TFX's StatisticsGen and ExampleValidator): tonight's corpus statistics
(:mod:`.statistics`), compared with the champion's under configured bounds (:mod:`.config`, :mod:`.report`),
read from and recorded in MLflow (:mod:`.records`)."""

STOPPED_EXIT_STATUS = 3
"""``kedro run``'s exit status when the data gate stopped the night (1: any other project error); the scheduler does
not retry it (the same corpus would stop it again). Here, where a scheduler can read it without importing more."""
