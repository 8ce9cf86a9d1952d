"""Units of size and rate, defined once for every layer.

Memory is counted in binary units, as the providers sell it (Lambda's "128 MB" tier is
128 × 2**20 bytes, so ``Tier.memory_mb`` counts MiB); bandwidth figures are decimal ("70 MB/s"
is 70e6 bytes per second), as the papers and the providers quote them.
"""

MIB = 1 << 20
GIB = 1 << 30
MB_S = 1_000_000            # bytes per second in one MB/s
GBIT_S = 125_000_000        # bytes per second in one Gbit/s


def mb(nbytes: float) -> str:
    """Bytes in the unit tiers are sold in (``Tier.memory_mb`` counts 2**20 bytes)."""
    return f"{nbytes / MIB:,.1f} MB"
