"""The names of the environment variables a function is started with: its role and its store's
address. A module of its own, importing nothing, so that a process that only starts functions
(a Ray task's worker, through ``runtime.forked``) names them without loading torch."""

ROLE_ENV = "FLATPACK_ROLE"
STORE_ENV = "FLATPACK_STORE"
