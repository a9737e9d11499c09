"""Torture testing: faults that a kill -9 cannot show, checked against the broker's guarantees.

``slipstream.torture._powerfs.PowerFS``: a FUSE filesystem that loses, at a simulated power
failure, every write not yet made durable.
"""
