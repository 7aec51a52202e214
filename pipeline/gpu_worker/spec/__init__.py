"""Speculative decoding in the worker: the speculation state, the draft model and the n-gram proposer."""
