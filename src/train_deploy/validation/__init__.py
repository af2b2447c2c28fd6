"""The data gate before training (TFX's StatisticsGen and ExampleValidator): tonight's corpus statistics
(:mod:`.statistics`), compared with the champion's under configured bounds (:mod:`.config`, :mod:`.report`),
read from and recorded in MLflow (:mod:`.records`)."""
