"""Validation: the continuous-batching episode a built artifact is driven through and its oracles
(``episode.py``); the ``validate`` stage runs it and writes validation.json."""
