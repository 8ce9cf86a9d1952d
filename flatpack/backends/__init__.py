"""Targets flatpack compiles for. Each target's package/deploy/invoke/teardown module lands
with its issue (local runtime: issue 6; clouds: issue 7); until then every target compiles
to the same stage artifacts."""

TARGETS = ("local", "aws-lambda", "alibaba-fc", "gpu-container")
