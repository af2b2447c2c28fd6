"""Where the corpus stage's chunks are encoded (``corpus.encoding.executor``): :mod:`.local` (this process and
spawned helpers) or :mod:`.ray` (Ray tasks); both run :class:`train_deploy.corpus.encode.ChunkEncoder` and show
one :class:`.progress.EncodingProgress`."""
