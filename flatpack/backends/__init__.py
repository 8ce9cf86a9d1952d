"""Targets flatpack compiles for. Each target's package/deploy/invoke/teardown module lands
with its issue (local runtime: issue 6; clouds: issue 7); until then every target compiles
to the same stage artifacts. The platform data behind each target (tiers, bandwidth, prices,
limits, with sources) is in :mod:`flatpack.backends.catalog`."""

from flatpack.backends.catalog import BUILTIN_PLATFORMS

# The built-in platform names, in the catalog's order: local, aws-lambda, alibaba-fc, gpu-container.
TARGETS = tuple(BUILTIN_PLATFORMS)
