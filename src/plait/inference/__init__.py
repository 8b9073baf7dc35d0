"""Decoding and serving tensor-parallel models: the decode loop and what ``plait generate``
builds around it.

- :mod:`~plait.inference.decode`: ``decode(model, prompt, steps)``, one forward a token with
  the KV cache (a static cache and a compiled step where asked), stopping at EOS.
- :mod:`~plait.inference.generate`: ``plait generate``'s config, model building, prompts
  and tokenizers, and the run on every rank.
- :mod:`~plait.inference.serve`: requests in turn, the split moved between them.
- :mod:`~plait.inference.split`: each rank's speed at the split layers, shares by speed,
  the capacity ideal of a step.
"""
