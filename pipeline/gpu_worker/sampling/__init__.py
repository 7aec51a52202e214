"""Sampling a step's logits: the sampler, penalties, log-probabilities, grammar masks and rejection sampling."""
