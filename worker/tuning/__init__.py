"""`batchwork tune`: measure a model's batch curve on the device, choose N, T and the token budget per lane.

``curve``, ``choice`` and ``history`` are pure arithmetic on measurements (no torch); ``measure`` and
``steps`` touch the device; ``report`` writes what a person reads; ``command`` is the CLI's body.
"""
