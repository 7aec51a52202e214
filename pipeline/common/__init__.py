"""What the three processes share: configuration, message layouts, rings.

Nothing here imports torch, so the scheduler can use it.
"""
