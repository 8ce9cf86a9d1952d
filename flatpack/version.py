"""flatpack's version and the schema versions of what it writes."""

__version__ = "0.1.0"

STAGE_SCHEMA_VERSION = 1
PLAN_SCHEMA_VERSION = 1
COMPILED_SCHEMA_VERSION = 1
