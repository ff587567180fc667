"""The Redis edge of batchwork: every key name, the transport workers fetch with, and the producers' path.

Nothing here runs models or touches SQL.
"""
