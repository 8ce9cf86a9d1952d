"""Opening a store by its url, wrapped as the caller asks: a function's bandwidth
(:mod:`.throttle`) and injected faults (:mod:`.chaos`).

Its own module because the wrappers build on :class:`~flatpack.runtime.store.WrappedStore`:
in ``store.py`` it would make store, throttle and chaos import each other.
"""

from __future__ import annotations

from typing import Any

from flatpack.runtime.chaos import wrap
from flatpack.runtime.store import Store, open_plain_store
from flatpack.runtime.throttle import Throttled


def open_store(url: str, **options: Any) -> Store:
    """Open the store a :attr:`Store.url` names.

    ``upload_bytes_s``/``download_bytes_s`` wrap it in :class:`~flatpack.runtime.throttle.Throttled`
    (emulating a function's network bandwidth); ``faults`` (a dict, see
    :func:`flatpack.runtime.chaos.wrap`) in a :class:`~flatpack.runtime.chaos.FaultyStore`
    that injects transient errors and stalls; other options go to the backend's constructor
    (e.g. ``read_timeout_s`` for S3, ``retry_s`` for S3, Redis and OSS, which their urls
    also accept as ``?retry_s=`` and ``?read_timeout_s=``; an option wins over the url).
    """
    upload = options.pop("upload_bytes_s", None)
    download = options.pop("download_bytes_s", None)
    faults = options.pop("faults", None)
    store = open_plain_store(url, **options)
    if faults:
        store = wrap(store, faults)
    if upload is None and download is None:
        return store
    return Throttled(store, upload_bytes_s=upload, download_bytes_s=download)
