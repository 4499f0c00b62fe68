"""Training data: byte tokenizer, synthetic tasks, the stdlib-source corpus, token shards and packed batches."""
