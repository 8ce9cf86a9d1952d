"""What the targets offer, as data: the catalog of tiers, bandwidth, prices, limits and base
images with the source of each number (:mod:`.catalog`), and the calibration files measured on
a target (:mod:`.calibration`), with the host-to-tier compute model they feed.

Beneath the partitioner, whose cost models read it, and beneath the backends, which deploy to
it; it imports only ``ir`` (the host a profile was measured on) and flatpack's leaf modules
(the layering: docs/architecture.md).
"""
