"""Each benchmark's settings: a typed, keyword-only dataclass whose fields are its flags.

They live apart from the code that runs them, which imports torch, so ``plait bench NAME
--help`` and every argument the command line refuses answer without importing it (a tenth
of a second here, against 2-4 s). The benchmark modules import their config from here, and
so can a user: ``from plait.bench.config.decode import DecodeBenchConfig``.
"""
