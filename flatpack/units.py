"""Byte units as the platforms sell memory: a tier's ``memory_mb`` counts 2**20 bytes."""

MIB = 1 << 20


def mb(nbytes: float) -> str:
    """Bytes in the unit tiers are sold in (``Tier.memory_mb`` counts 2**20 bytes)."""
    return f"{nbytes / MIB:,.1f} MB"
